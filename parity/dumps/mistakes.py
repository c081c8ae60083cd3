"""Input mistakes: a candidate that ran other token ids than the reference, in one of the ways ports really do.

A candidate that records the ids it ran (an engine dump: ``input_ids``) is compared with the reference's before
any activation, at the pseudo-point ``input_ids`` (parity.names.INPUT_IDS, before ``embed``). Ids that differ in
one of the ways below are a porting bug the check fails and names (exit 1), without comparing the activations:
position by position they would be compared against another input. Any other difference is another input, and
no verdict (exit 2). These are mistakes in what the engine is fed, not in its conventions, so they are not in the
catalog of parity.diagnosis.bugs (whose bugs are injected into a neutral model): docs/bugs.md, "Input mistakes".
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class InputMistake:
    id: str
    mistake: str      # one line, for `parity bugs`
    seen_in: str      # where it happened in public ports (tests/fixtures/citations.md, "Input mistakes")


MISTAKES = (
    InputMistake("bos-doubled", "the BOS token added twice: the tokenizer adds one and the chat template or the "
                                "caller another",
                 "vllm-project/vllm #16028, PR #16976; ggml-org/llama.cpp PR #7332; sgl-project/sglang PR #888"),
    InputMistake("bos-dropped", "the BOS token the reference starts with left out (the tokenizer's add_bos_token "
                                "lost on the way)",
                 "oobabooga/textgen PR #6050; EleutherAI/lm-evaluation-harness PR #2052"),
    InputMistake("prompt-shifted", "the prompt fed one position off: as many ids, each one place to the right or "
                                   "to the left of the reference's",
                 "no public instance found"),
)
SHOWS = "fails at input_ids, before embed (a dump's ids)"   # how each shows, for `parity bugs`


@dataclass(frozen=True)
class Found:
    """An input mistake found in the ids a candidate ran: its id, one line of evidence, and how many positions (of
    the longer of the two) hold another token than the reference's."""

    bug: str
    evidence: str
    differing: int
    ran: tuple[int, ...]     # the ids the candidate ran

    def diagnosis(self) -> dict:
        return {"bug": self.bug, "confidence": 1.0, "evidence": self.evidence}


def bos_id(config: dict) -> int | None:
    """The checkpoint's BOS token id: its config's ``bos_token_id`` (a multimodal config's text config's), or None."""
    for c in (config, config.get("text_config") or {}):
        bos = c.get("bos_token_id") if isinstance(c, dict) else None
        if isinstance(bos, int) and not isinstance(bos, bool):
            return bos
    return None


def classify(ran: list[int], reference: list[int], bos: int | None, runner: str = "the dump") -> Found | None:
    """The input mistake that turns ``reference`` into ``ran`` (one row of token ids each), or None where they
    differ in another way (or not at all). ``bos``: the checkpoint's BOS id (None: no BOS mistake can be named);
    ``runner``: who ran ``ran``, for the evidence."""
    if ran == reference:
        return None
    n, m = len(ran), len(reference)
    differing = sum(a != b for a, b in zip(ran, reference)) + abs(n - m)

    def found(bug: str, evidence: str) -> Found:
        return Found(bug, evidence, differing, tuple(ran))

    if bos is not None and reference and reference[0] == bos:
        if n == m + 1 and ran[:2] == [bos, bos] and ran[1:] == reference:
            return found("bos-doubled", f"{runner} ran 2 BOS tokens (id {bos}) before the prompt; the reference 1 "
                                        f"({n} tokens for {m})")
        if ran == reference[1:]:
            return found("bos-dropped", f"{runner} ran no BOS token (id {bos}) before the prompt; the reference 1 "
                                        f"({n} tokens for {m})")
    if n == m > 1:
        if ran[1:] == reference[:-1]:
            return found("prompt-shifted", f"{runner} ran the reference's {m} ids one position to the right (its "
                                           f"position k+1 holds the reference's k; it starts with id {ran[0]} and "
                                           f"drops the last, id {reference[-1]})")
        if ran[:-1] == reference[1:]:
            return found("prompt-shifted", f"{runner} ran the reference's {m} ids one position to the left (its "
                                           f"position k holds the reference's k+1; it drops the first, id "
                                           f"{reference[0]}, and ends with id {ran[-1]})")
    return None
