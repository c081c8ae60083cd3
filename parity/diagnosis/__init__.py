"""The porting-bug catalog and the diagnosis that replays it."""
