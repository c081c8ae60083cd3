"""`parity convert --to gguf --gguf-type Q4_K_M` and the other types llama.cpp's own quantizer makes: the file holds
the types llama.cpp chose (its mix, its fallbacks for rows that do not fit a block), the summary says which, it
loads in llama.cpp, and a failure or an interrupt leaves nothing behind."""

from __future__ import annotations

import json
import subprocess

import pytest
from click.testing import CliRunner

from parity.cli import cli
from parity.engines.gguf import file as gguf_file
from parity.engines.gguf import quantize as gguf_quantize
from parity.engines.gguf.export import TYPES, export
from parity.errors import ParityError
from tests.conftest import ADAPTERS

pytest.importorskip("gguf")
llama_cpp = pytest.importorskip("llama_cpp")

# rows of 256 and 512 columns: every matrix fits the K-quants' 256-column block (head_dim 64, 4 heads, 2 of k/v)
WIDE = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 64}
ASKED = ("Q4_0", "Q4_1", "Q4_K_M")


def _cli(*args):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


def _left(directory, keep=()):
    """What a convert left in the directory, but the inputs."""
    return sorted(p.name for p in directory.iterdir() if p.name not in keep)


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    from parity.reference.tiny import build_model

    path = tmp_path_factory.mktemp("wide") / "llama"
    build_model(ADAPTERS["llama"], overrides=WIDE).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def written(wide, tmp_path_factory):
    """{type: (file, what convert printed)}, each written once through the CLI."""
    root = tmp_path_factory.mktemp("quantized")
    made = {}
    for qtype in ASKED:
        out = root / f"{qtype}.gguf"
        result = _cli("convert", wide, "--to", "gguf", "-o", out, "--gguf-type", qtype)
        assert result.exit_code == 0, result.output
        made[qtype] = (out, result.output)
    assert _left(root) == sorted(f"{t}.gguf" for t in ASKED)  # no temporaries beside them
    return made


def test_every_type_the_option_offers_is_one_the_exporter_makes():
    option = next(p for p in cli.commands["convert"].params if p.name == "gguf_type")
    assert list(option.type.choices) == [*TYPES, *gguf_quantize.LLAMA_TYPES]
    for qtype, (name, base) in gguf_quantize.LLAMA_TYPES.items():
        assert gguf_quantize.ftype(qtype) == getattr(llama_cpp, name), qtype
        assert name == f"LLAMA_FTYPE_MOSTLY_{qtype}"


@pytest.mark.parametrize("qtype", ASKED)
def test_the_file_holds_the_asked_type_in_llama_cpps_mix(qtype, written):
    out, printed = written[qtype]
    header = gguf_file.header_types(out)
    types = {name: h[0] for name, h in header.items()}
    vectors = {name for name, h in header.items() if h[2] == 1}
    assert vectors and all(types[n] == "F32" for n in vectors)  # norms (and rope_freqs) stay F32
    matrices = {name: t for name, t in types.items() if name not in vectors}
    # llama.cpp's mix: output.weight in Q6_K for every type here; a _M mix gives attn_v and ffn_down more bits in
    # the layers its use_more_bits picks (i >= 7n/8 in integers: layer 1 of 2)
    bumped = {"output.weight"} | ({"blk.1.attn_v.weight", "blk.1.ffn_down.weight"} if qtype == "Q4_K_M" else set())
    base = gguf_quantize.LLAMA_TYPES[qtype][1]
    assert {n for n, t in matrices.items() if t == "Q6_K"} == bumped
    assert all(t == base for n, t in matrices.items() if n not in bumped), matrices
    assert len(matrices) == 16 and "token_embd.weight" in matrices
    counts = f"{16 - len(bumped)} {base}, {len(bumped)} Q6_K"
    assert f"{qtype} asked; matrices: {counts}; vectors: {len(vectors)} F32" in printed


@pytest.mark.parametrize("qtype", ASKED)
def test_the_quantized_file_loads_and_runs_in_llama_cpp(qtype, written, wide, tmp_path):
    """A verdict, 0 or 1 (the quantization error itself is not judged here), never 2: llama.cpp ran it."""
    out, _ = written[qtype]
    result = _cli("check", "--reference", wide, "--candidate", out, "--layerwise", "--report", tmp_path / "r.json")
    assert result.exit_code in (0, 1), result.output
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["candidate"]["kind"] == "gguf"
    assert sum(p["compared"] for p in report["points"]) > 10


def test_rows_that_do_not_fit_the_block_fall_back_and_the_summary_says_so(tmp_path, tiny_dir):
    """The tiny Llama's rows are 64 and 128 columns: llama.cpp stores Q4_K as Q5_0 and Q6_K as Q8_0."""
    done = export(tiny_dir("llama"), tmp_path / "narrow.gguf", qtype="Q4_K_M")
    header = gguf_file.header_types(tmp_path / "narrow.gguf")
    assert done["tensors"] == {n: h[0] for n, h in header.items()}
    matrices = {n: done["tensors"][n] for n, h in header.items() if h[2] == 2}
    assert set(matrices.values()) == {"Q5_0", "Q8_0"}
    assert {n for n, t in matrices.items() if t == "Q8_0"} == {"output.weight", "blk.1.attn_v.weight",
                                                               "blk.1.ffn_down.weight"}
    assert done["summary"] == "Q4_K_M asked; no rows a multiple of 256, so fell back: 13 Q5_0, 3 Q8_0; vectors: 6 F32"
    assert _left(tmp_path) == ["narrow.gguf"]


def test_the_summary_splits_rows_that_fit_from_those_that_fell_back():
    header = {"a": ("Q4_K", 256, 2), "b": ("Q4_K", 512, 2), "c": ("Q6_K", 256, 2), "d": ("Q5_0", 320, 2),
              "e": ("Q8_0", 96, 2), "n": ("F32", 256, 1)}
    assert gguf_quantize.summary("Q4_K_M", header) == ("Q4_K_M asked; rows a multiple of 256: 2 Q4_K, 1 Q6_K; "
                                                       "other rows fell back: 1 Q5_0, 1 Q8_0; vectors: 1 F32")
    assert gguf_quantize.summary("F16", {"a": ("F16", 64, 2), "n": ("F32", 64, 1)}) == \
        "F16 asked; matrices: 1 F16; vectors: 1 F32"


def test_a_type_the_exporter_cannot_make_is_refused_with_nothing_written(tmp_path, wide):
    result = CliRunner().invoke(cli, ["convert", str(wide), "--to", "gguf", "-o", str(tmp_path / "x.gguf"),
                                      "--gguf-type", "Q4_K_L"])
    assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1
    assert "Q4_K_L" in result.stderr
    with pytest.raises(ParityError, match="not one the exporter makes: F32, F16, Q8_0, Q4_0, .*Q6_K$"):
        export(wide, tmp_path / "x.gguf", qtype="IQ2_XS")
    assert _left(tmp_path) == []


def test_llama_cpp_failing_is_one_line_and_leaves_nothing(tmp_path, wide, monkeypatch):
    """llama.cpp's own reason (here: a file type it does not quantize to) becomes the error; the unquantized
    file and the temporary directory are gone."""
    monkeypatch.setitem(gguf_quantize.LLAMA_TYPES, "Q4_0", ("LLAMA_FTYPE_GUESSED", "Q4_0"))
    result = CliRunner().invoke(cli, ["convert", str(wide), "--to", "gguf", "-o", str(tmp_path / "x.gguf"),
                                      "--gguf-type", "Q4_0"])
    assert result.exit_code == 2, result.output
    line = result.stderr.strip()
    assert len(line.splitlines()) == 1
    assert "llama.cpp's quantizer failed making Q4_0" in line and "invalid output file type 1024" in line
    assert _left(tmp_path) == []


def test_an_interrupt_stops_llama_cpp_and_leaves_nothing(tmp_path, wide, monkeypatch):
    started = []

    class Interrupted(subprocess.Popen):
        def communicate(self, *args, **kwargs):
            started.append(self)
            raise KeyboardInterrupt

    monkeypatch.setattr(gguf_quantize.subprocess, "Popen", Interrupted)
    with pytest.raises(KeyboardInterrupt):
        export(wide, tmp_path / "x.gguf", qtype="Q4_K_M")
    assert started and started[0].returncode is not None  # killed and reaped, not left running
    assert _left(tmp_path) == []


def test_without_llama_cpp_python_one_line_names_the_extra(tmp_path, wide, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "llama_cpp", None)  # import llama_cpp raises ImportError
    result = CliRunner().invoke(cli, ["convert", str(wide), "--to", "gguf", "-o", str(tmp_path / "x.gguf"),
                                      "--gguf-type", "Q4_K_M"])
    assert result.exit_code == 2
    assert len(result.stderr.strip().splitlines()) == 1 and "pip install 'parity[llama]'" in result.stderr
    assert _left(tmp_path) == []
    assert _cli("convert", wide, "--to", "gguf", "-o", tmp_path / "q8.gguf", "--gguf-type", "Q8_0").exit_code == 0
