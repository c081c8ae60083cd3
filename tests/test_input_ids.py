"""Input mistakes: an engine dump that ran the reference's ids with a BOS doubled or dropped, or shifted by one,
fails at input_ids and is named (parity.dumps.mistakes); any other difference stays no verdict (exit 2).

The dumps hold transformers' own activations for the ids they ran, as an engine that made the mistake would."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from parity.cli import cli
from parity.dumps import write_dump
from parity.dumps.mistakes import MISTAKES, bos_id, classify

ROOT = Path(__file__).resolve().parent.parent
BOS = 1  # the tiny checkpoints' bos_token_id (checked below against the config)
PROMPT = [BOS, 40, 50, 60, 70, 80, 90, 100]
WRONG = {  # the ids each mistake runs instead of PROMPT
    "bos-doubled": [BOS] + PROMPT,
    "bos-dropped": PROMPT[1:],
    "prompt-shifted": [5] + PROMPT[:-1],
}


@pytest.fixture(scope="module")
def llama(tiny_dir):
    """The tiny llama checkpoint and dump(ids, path): transformers' activations for ``ids``, written as a dump."""
    from transformers import AutoModelForCausalLM

    path = tiny_dir("llama")
    assert bos_id(json.loads((path / "config.json").read_text())) == BOS
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()

    def dump(ids: list[int], out: Path) -> Path:
        with torch.no_grad():
            run = model(input_ids=torch.tensor([ids]), output_hidden_states=True)
        # embed is the stream entering layer 0, layers.0.out the one leaving it (2 layers: not the final norm's)
        return write_dump(out, {"embed": run.hidden_states[0], "layers.0.out": run.hidden_states[1],
                                "logits": run.logits}, ids)

    return {"reference": path, "dump": dump}


def check(reference: Path, candidate: Path, *extra: str):
    return CliRunner().invoke(cli, ["check", "--reference", str(reference), "--candidate", str(candidate),
                                    "--layerwise", "--ids", ",".join(map(str, PROMPT)), *extra])


@pytest.mark.parametrize("bug", sorted(WRONG))
def test_an_input_mistake_fails_at_input_ids_and_is_named(llama, tmp_path, bug):
    dump = llama["dump"](WRONG[bug], tmp_path / "dump.safetensors")
    report_path = tmp_path / "report.json"
    result = check(llama["reference"], dump, "--report", str(report_path))
    assert result.exit_code == 1, result.output
    assert "FAIL at input_ids" in result.stdout and bug in result.stdout
    assert "no activation was compared" in result.stdout
    report = json.loads(report_path.read_text())
    assert report["verdict"] == "fail" and report["first_divergence"]["point"] == "input_ids"
    assert [d["bug"] for d in report["diagnosis"]] == [bug] and report["diagnosis"][0]["confidence"] == 1.0
    (point,) = report["points"]  # the activations are not compared: another input
    assert point["name"] == "input_ids" and point["passed"] is False and point["compared"] is True
    assert point["max_abs"] == sum(a != b for a, b in zip(WRONG[bug], PROMPT)) + abs(len(WRONG[bug]) - len(PROMPT))
    assert point["rel_l2"] is None and point["cosine"] is None
    assert report["inputs"]["runs"][0]["candidate_ids"] == WRONG[bug]
    assert set(report) >= {"parity_report_version", "family", "reference", "candidate", "dtype", "mode", "logits"}


def test_the_evidence_says_what_the_dump_ran():
    assert classify([BOS] + PROMPT, PROMPT, BOS).evidence == ("the dump ran 2 BOS tokens (id 1) before the prompt; "
                                                              "the reference 1 (9 tokens for 8)")
    assert classify(PROMPT[1:], PROMPT, BOS).evidence.startswith("the dump ran no BOS token (id 1)")
    left = classify(PROMPT[1:] + [7], PROMPT, BOS)
    assert left.bug == "prompt-shifted" and "to the left" in left.evidence
    assert "to the right" in classify([5] + PROMPT[:-1], PROMPT, BOS).evidence
    # the precise patterns only: no BOS known, a reference without one, two ids changed, a BOS tripled
    assert classify([BOS] + PROMPT, PROMPT, None) is None
    assert classify([BOS] + PROMPT[1:], PROMPT[1:], BOS) is None
    assert classify(PROMPT[1:], PROMPT, 2) is None
    assert classify([BOS, BOS] + PROMPT, PROMPT, BOS) is None
    assert classify([PROMPT[0], 9, 9] + PROMPT[3:], PROMPT, BOS) is None
    assert classify(PROMPT, PROMPT, BOS) is None


def test_another_difference_is_no_verdict_and_the_right_ids_pass(llama, tmp_path):
    other = llama["dump"]([BOS, 41, 50, 60, 70, 80, 90, 100], tmp_path / "other.safetensors")
    result = check(llama["reference"], other)
    assert result.exit_code == 2, result.output
    assert "input ids differ from the reference's" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    good = llama["dump"](PROMPT, tmp_path / "good.safetensors")
    assert check(llama["reference"], good).exit_code == 0


def test_the_decode_path_and_rank_dumps_are_named_too(llama, tmp_path):
    dump = llama["dump"](WRONG["bos-doubled"], tmp_path / "dump.safetensors")
    decode = check(llama["reference"], dump, "--decode", "2")  # named before the dump's decode steps are read
    assert decode.exit_code == 1 and "bos-doubled" in decode.stdout, decode.output
    ranks = tmp_path / "ranks"
    ranks.mkdir()
    tensors = load_file(dump)
    for rank in range(2):  # a tensor-parallel run's two rank dumps, every point replicated
        save_file(tensors, ranks / f"rank{rank}.safetensors",
                  metadata={"input_ids": json.dumps(WRONG["bos-doubled"]), "tp_rank": str(rank), "tp_size": "2"})
    result = check(llama["reference"], ranks)
    assert result.exit_code == 1 and "bos-doubled" in result.stdout, result.output


def test_parity_bugs_lists_the_input_mistakes_and_the_docs_cite_only_verified_ones():
    rows = json.loads(CliRunner().invoke(cli, ["bugs", "--json"]).stdout)
    inputs = [r for r in rows if r["kind"] == "input"]
    assert [r["id"] for r in inputs] == [m.id for m in MISTAKES] == ["bos-doubled", "bos-dropped", "prompt-shifted"]
    assert all(r["mistake"] and r["shows"] and r["seen_in"] for r in inputs)
    from tests.test_readme import NONE_FOUND, cells, references

    text = (ROOT / "tests" / "fixtures" / "citations.md").read_text()
    table = re.search(r"^\| input mistake id .*?(?=\n\n|\Z)", text, re.S | re.M)[0]
    verified = {row[0]: row[1] for row in cells(table)}
    assert set(verified) == {m.id for m in MISTAKES}
    section = (ROOT / "docs" / "bugs.md").read_text().split("## Input mistakes", 1)[1].split("\n## ", 1)[0]
    documented = {row[0].strip("`"): row for row in cells(re.search(r"^\| id .*?(?=\n\n|\Z)", section, re.S | re.M)[0])}
    dumps_doc = (ROOT / "docs" / "dumps.md").read_text()
    for m in MISTAKES:
        assert documented[m.id][1] == m.mistake and documented[m.id][-1] == m.seen_in, m.id
        assert f"`{m.id}`" in dumps_doc, m.id
        if verified[m.id].startswith("—"):
            assert m.seen_in == NONE_FOUND, m.id
            continue
        refs = references(m.seen_in)[1]
        assert refs and refs <= references(verified[m.id])[1], m.id
