"""CTranslate2: the candidate kind (kind.py), its Generator run and its model.bin read."""
