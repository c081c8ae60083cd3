"""Layer streaming (parity.storage.lazy): the same numbers as the whole models, one layer of weights at a time.

The streamed reference is transformers' own model, so it must give transformers' own logits bit for bit;
the streamed executor must give the executor's. While a streamed model runs, at most one decoder layer
holds real weights, embeddings read only the rows the prompt uses and the head is applied in chunks.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from parity import candidates
from parity.candidates import neutral as neutral_kind
from parity.checker import prefill
from parity.checker import run as runner
from parity.checkpoint import open_checkpoint
from parity.checkpoint.inputs import make_inputs
from parity.errors import ParityError
from parity.neutral.executor.model import NeutralModel
from parity.neutral.manifest import load
from parity.reference import models
from parity.storage import lazy
from tests.conftest import FAMILIES


def _logits(out):
    return out.logits if getattr(out, "logits", None) is not None else out[0]


@pytest.mark.parametrize("family", FAMILIES)
def test_streamed_reference_is_transformers_bit_for_bit(family, tiny_dir):
    ckpt = open_checkpoint(tiny_dir(family))
    cls = getattr(transformers, ckpt.variant.architectures[0])
    ids = make_inputs(ckpt).ids
    whole = cls.from_pretrained(ckpt.path, attn_implementation="eager", dtype=torch.float32).eval()
    streamed = lazy.streamed_hf(cls, ckpt, torch.float32)
    layers = [streamed.get_submodule(c.module) for c in ckpt.resolved.capture if c.name.endswith(".out")
              and c.name.startswith("layers.")]
    real_during: list[int] = []
    for layer in layers:  # when a layer starts, it is the only one holding weights
        layer.register_forward_pre_hook(lambda *_: real_during.append(
            sum(any(not p.is_meta for p in m.parameters()) for m in layers)))
    with torch.no_grad():
        expected, got, again = _logits(whole(input_ids=ids)), _logits(streamed(input_ids=ids)), \
            _logits(streamed(input_ids=ids))
    assert torch.equal(expected, got) and torch.equal(got, again)
    assert real_during == [1] * len(layers) * 2
    assert all(p.is_meta for layer in layers for p in layer.parameters())  # and none after


@pytest.mark.parametrize("family", ["llama", "gemma4", "deepseek_v3", "bert"])
def test_streamed_executor_equals_the_whole_executor(family, neutral_dir):
    manifest, tensors = load(neutral_dir(family))
    _, source = load(neutral_dir(family), lazy=True)
    ckpt_vocab = manifest.tensors["embed.tokens.weight"].shape[0]
    ids = torch.tensor([[3 + (7919 * k) % (ckpt_vocab - 3) for k in range(40)]])
    seen_whole, seen_streamed = {}, {}
    expected = NeutralModel(manifest, tensors)(ids, on_point=lambda n, t: seen_whole.setdefault(n, t.clone()))
    got = NeutralModel(manifest, source)(ids, on_point=lambda n, t: seen_streamed.setdefault(n, t.clone()))
    assert torch.equal(expected, got)
    assert seen_whole.keys() == seen_streamed.keys()
    assert all(torch.equal(seen_whole[k], seen_streamed[k]) for k in seen_whole)


def test_embedding_reads_only_the_prompts_rows_and_the_head_in_chunks(neutral_dir, monkeypatch):
    _, source = load(neutral_dir("llama"), lazy=True)
    reads: list[tuple[str, int, int | None]] = []
    original = lazy.TensorFiles.read

    def spy(self, name, start=0, stop=None, **kw):
        reads.append((name, start, stop))
        return original(self, name, start, stop, **kw)

    monkeypatch.setattr(lazy.TensorFiles, "read", spy)
    vocab, hidden = source.shape("embed.tokens.weight")
    monkeypatch.setattr(lazy, "CHUNK_BYTES", hidden * 4 * 64)  # 64 rows of float32 at a time
    manifest, _ = load(neutral_dir("llama"))
    model = NeutralModel(manifest, source)
    ids = torch.tensor([[5, 6, 7, 40, 5]])
    model(ids)
    rows = [(a, b) for n, a, b in reads if n == "embed.tokens.weight" and b is not None and b - a < vocab]
    assert sorted(rows)[:2] == [(5, 8), (40, 41)]  # consecutive ids in one read, repeated ids once
    head = "embed.tokens.weight" if manifest.head.tied else "lm_head.weight"
    chunks = [(a, b) for n, a, b in reads if n == head and (b or vocab) - a == 64]
    assert len(chunks) >= vocab // 64 - 1
    assert not any(n == head and a == 0 and b is None for n, a, b in reads)  # never the whole table


@pytest.mark.parametrize("family", ["gemma2", "gpt2"])
def test_streamed_check_gives_the_same_report(family, tiny_dir, neutral_dir):
    reports = [runner.check(tiny_dir(family), neutral_dir(family), layerwise=True, calibrate=True, stream=s)
               for s in (False, True)]
    assert [p.rel_l2 for p in reports[0].points] == [p.rel_l2 for p in reports[1].points]
    assert all(reports)


def test_streamed_check_still_fails_a_broken_port(tiny_dir, neutral_dir):
    report = runner.check(tiny_dir("gemma2"), neutral_dir("gemma2"), layerwise=True, stream=True,
                          inject="norm-offset-dropped")
    assert not report and report.exit_code == 1
    assert report.first_divergence.name == "layers.0.attn_in"
    assert report.diagnosis[0]["bug"] == "norm-offset-dropped"


def test_streaming_turns_on_when_the_models_would_not_fit(tiny_dir, neutral_dir, monkeypatch):
    ckpt = open_checkpoint(tiny_dir("llama"))
    shapes = candidates.get("neutral").shapes(neutral_dir("llama"))
    monkeypatch.setattr(models, "free_memory", lambda device: 10**12)
    assert not models.would_not_fit(ckpt, "float32", False, "cpu", shapes)
    monkeypatch.setattr(models, "free_memory", lambda device: 4096)
    assert models.would_not_fit(ckpt, "float32", False, "cpu", shapes)
    used = []
    monkeypatch.setattr(lazy, "streamed_hf", lambda *a, **k: used.append(True) or
                        (_ for _ in ()).throw(RuntimeError("streamed")))
    with pytest.raises(ParityError, match="RuntimeError: streamed"):
        runner.check(tiny_dir("llama"), neutral_dir("llama"))
    assert used


def test_final_only_holds_only_what_it_compares(tiny_dir, neutral_dir, monkeypatch):
    emitted: list[str] = []
    original = models.Stream.__init__

    def spy(self, run, label, **options):
        original(self, lambda emit: run(lambda n, t: (emitted.append(n), emit(n, t))), label, **options)

    monkeypatch.setattr(models.Stream, "__init__", spy)
    report = runner.check(tiny_dir("llama"), neutral_dir("llama"))
    assert report and emitted == ["logits"]


def test_devices_are_checked_before_anything_runs(tiny_dir, neutral_dir):
    with pytest.raises(ParityError, match="not one of cpu, cuda"):
        runner.check(tiny_dir("llama"), neutral_dir("llama"), device="tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ParityError, match="no CUDA GPU"):
            runner.check(tiny_dir("llama"), neutral_dir("llama"), device="cuda:0")
    assert models.resolve_device("auto") in ("cpu", "mps", "cuda:0", "auto")


def test_held_whole_the_reference_runs_first_and_is_dropped_before_the_candidate_loads(tiny_dir, neutral_dir,
                                                                                     monkeypatch):
    held: list[list] = []  # the transformers models held when the candidate loads
    original = neutral_kind.load

    def spy(loaded, *args, **kwargs):
        held.append([key for key in loaded.loaded if key[0] == "hf"])
        return original(loaded, *args, **kwargs)

    monkeypatch.setattr(neutral_kind, "load", spy)
    ahead = runner.check(tiny_dir("llama"), neutral_dir("llama"), layerwise=True, stream=False)
    assert ahead and held == [[]]
    # points too many to hold beside the models: the two run in step, the reference held throughout
    held.clear()
    monkeypatch.setattr(prefill, "points_fit", lambda *args: False)
    in_step = runner.check(tiny_dir("llama"), neutral_dir("llama"), layerwise=True, stream=False)
    assert in_step and len(held) == 1 and len(held[0]) == 1
    assert [(p.name, p.rel_l2) for p in in_step.points] == [(p.name, p.rel_l2) for p in ahead.points]
