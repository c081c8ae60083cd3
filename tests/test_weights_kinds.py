"""Each kind's ``weights(path, engine)`` (parity/candidates/weights.py): how a candidate stores its weights, read from
its headers (a GGUF's tensor infos, an ONNX graph's initializers, an IR's .xml, a model.bin's variables, safetensors
headers) or, for a checkpoint an engine converts, from the engine options, without converting. The numbers are
derived here from the files' shapes and each format's layout, not from the code under test: a Q8_0 block is 34
bytes for 32 weights, a Q4_K block 144 for 256, an int4 MatMulNBits block of 32 half a byte each plus a float32
scale, mlx's affine 4-bit a float32 scale and bias per group of 64."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from parity.candidates import get
from parity.cli import cli
from parity.errors import ParityError
from tests.conftest import ADAPTERS

# rows of 256 and 512 columns: every matrix fits a K-quant's 256-weight block and NNCF's groups of 128
WIDE = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 64}
REAL = Path(os.environ.get("PARITY_REAL_QWEN", Path.home() / ".cache/parity-real/qwen2.5-coder-0.5b"))


def _cli(*args):
    result = CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result


def _weights(kind: str, path, engine=None):
    return get(kind).weights(Path(path), engine or {})


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """The tiny Llama (hidden 64, 2 layers, untied head; with the tokenizer the engines' converters read) and its
    wide twin, as Hugging Face checkpoints."""
    from parity.reference.tiny import build_model, make_tiny

    root = tmp_path_factory.mktemp("weights")
    make_tiny(ADAPTERS["llama"], root / "llama")
    build_model(ADAPTERS["llama"], overrides=WIDE).save_pretrained(root / "wide")
    return root


@pytest.fixture(scope="module")
def engine_cache(tmp_path_factory):
    """The engines' conversions go to a cache of this module's own (PARITY_CACHE), empty at first."""
    with pytest.MonkeyPatch.context() as mp:
        cache = tmp_path_factory.mktemp("parity-cache")
        mp.setenv("PARITY_CACHE", str(cache))
        yield cache


# ---------------------------------------------------------------------------------------------------------------------
# ONNX (fast: parity's own exports, quantized by onnxruntime)


@pytest.fixture(scope="module")
def graphs(llama):
    """{mode: the tiny Llama's ONNX export}: float32 (parity convert), float16 (onnxruntime's converter of it), and
    quantized by onnxruntime (parity convert --onnx-quant's quantize_graph)."""
    pytest.importorskip("onnxruntime.quantization")
    import onnx
    from onnxruntime.transformers.float16 import convert_float_to_float16

    from parity.engines.onnx.quantize import _default_ids, quantize_graph

    made = {"float32": llama / "float32.onnx", "float16": llama / "float16.onnx"}
    _cli("convert", llama / "llama", "--to", "onnx", "-o", made["float32"])
    onnx.save(convert_float_to_float16(onnx.load(str(made["float32"])), keep_io_types=True), str(made["float16"]))
    for mode in ("int8-dynamic", "qdq", "int4"):
        made[mode] = llama / f"{mode}.onnx"
        quantize_graph(made["float32"], made[mode], mode, _default_ids(llama / "llama", ()))
    return made


def _projections(checkpoint: Path) -> dict[str, tuple[int, int]]:
    """The checkpoint's projection matrices, [out, in] (the head's among them; the embedding is looked up)."""
    return {name: d for name, d in _checkpoint_shapes(checkpoint).items() if len(d) == 2 and "embed" not in name}


def _checkpoint_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "np") as f:
        return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}


def test_onnx_float_graphs_are_not_quantized_and_float16_is_rounded(graphs, llama):
    shapes = _checkpoint_shapes(llama / "llama")  # the export's weights are the checkpoint's, not its constants
    total = sum(math.prod(d) for d in shapes.values())
    w = _weights("onnx", graphs["float32"])
    assert len(shapes) == 21 and w.types == {"float32": 21} and w.parameters == {"float32": total}
    assert w.bits_per_weight == 32.0 and not w.quantized and not w.rounded and w.scheme == ""
    w = _weights("onnx", graphs["float16"])
    assert w.types == {"float16": 21} and w.parameters == {"float16": total} and w.bits_per_weight == 16.0
    assert not w.quantized and w.rounded and w.words() == "not quantized (float16 weights, 16 bits per weight)"


def test_onnx_int8_dynamic_names_its_ops_and_counts_its_scales(graphs, llama):
    projections = _projections(llama / "llama")
    norms = 5 * 64
    embedding = 256 * 64
    w = _weights("onnx", graphs["int8-dynamic"])
    assert w.scheme == "int8, dynamic activations (DynamicQuantizeLinear + MatMulInteger)"
    assert w.types == {"int8": 15, "uint8": 1, "float32": 5}  # 15 projections; quantize_dynamic's uint8 embedding
    assert w.parameters == {"int8": sum(math.prod(d) for d in projections.values()), "uint8": embedding,
                            "float32": norms}
    assert w.notes == ("uint8 embedding",)
    # a byte per weight, 4 per norm weight, and a float32 scale and an 8-bit zero point for each of the 16 tensors
    stored = sum(w.parameters.values()) - norms + 4 * norms + 16 * 5
    assert w.bits_per_weight == round(8 * stored / sum(w.parameters.values()), 2) == 8.08
    assert w.quantized and w.words().startswith("quantized: int8, dynamic activations")


def test_onnx_qdq_and_its_float_embedding(graphs):
    w = _weights("onnx", graphs["qdq"])
    assert w.scheme == "int8 QDQ (QuantizeLinear/DequantizeLinear)"
    assert w.types == {"int8": 15, "float32": 6} and w.notes == ("float32 embedding",)


def test_onnx_int4_says_blocks_of_32_and_its_bits_are_the_blocks(graphs, llama):
    projections = _projections(llama / "llama")
    w = _weights("onnx", graphs["int4"])
    assert w.scheme == "int4 blocks of 32 (MatMulNBits)" and w.types == {"int4": 15, "float32": 6}
    assert w.parameters["int4"] == sum(math.prod(d) for d in projections.values())  # N x K, not the packed bytes
    # per row of K: K/2 bytes of nibbles, a float32 scale per block of 32, the blocks' zero points two a byte
    stored = sum(n * (k // 2 + 4 * (k // 32) + math.ceil(k // 32 / 2)) for n, k in projections.values())
    stored += 4 * w.parameters["float32"]  # the float32 embedding and norms
    assert w.bits_per_weight == round(8 * stored / sum(w.parameters.values()), 2)
    matrices = 8 * (stored - 4 * w.parameters["float32"]) / w.parameters["int4"]
    assert 5.1 < matrices < 5.3  # 4 bits, a 32-bit scale per 32, 4 bits of zero point per 32: 5.125 on the matrices


def test_onnx_external_data_is_counted_from_dims_without_reading_it(graphs, tmp_path):
    import onnx

    model = onnx.load(str(graphs["int4"]))
    onnx.save(model, str(tmp_path / "model.onnx"), save_as_external_data=True, location="model.onnx.data",
              size_threshold=0)
    data = tmp_path / "model.onnx.data"
    assert data.stat().st_size > 100_000
    assert _weights("onnx", tmp_path) == _weights("onnx", graphs["int4"])
    data.write_bytes(data.read_bytes()[:1000])  # truncated: refused by open_model's check, in one line
    with pytest.raises(ParityError, match="truncated"):
        _weights("onnx", tmp_path)


def _graph(nodes, inits, path):
    """A one-projection graph, X [1, 4, 64] -> Y [1, 4, 32], around ``nodes`` and ``inits`` (numpy arrays)."""
    import onnx
    from onnx import helper, numpy_helper

    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("X", onnx.TensorProto.FLOAT, [1, 4, 64])],
                              [helper.make_tensor_value_info("Y", onnx.TensorProto.FLOAT, [1, 4, 32])],
                              [numpy_helper.from_array(v, k) for k, v in inits.items()])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), str(path))
    return path


def test_onnx_qlinear_matmul_and_the_weight_only_cast_form(tmp_path):
    from onnx import helper

    q = np.random.default_rng(0).integers(-127, 128, (64, 32), dtype=np.int8)
    scale, zero = np.float32(0.01), np.int8(0)
    qlinear = _graph([helper.make_node("QuantizeLinear", ["X", "xs", "xz"], ["Xq"]),
                      helper.make_node("QLinearMatMul", ["Xq", "xs", "xz", "W", "ws", "wz", "ys", "yz"], ["Yq"]),
                      helper.make_node("DequantizeLinear", ["Yq", "ys", "yz"], ["Y"])],
                     {"W": q, "ws": scale, "wz": zero, "xs": scale, "xz": zero, "ys": scale, "yz": zero},
                     tmp_path / "qlinear.onnx")
    w = _weights("onnx", qlinear)
    assert w.scheme == "int8 QLinearMatMul" and w.types == {"int8": 1} and w.parameters == {"int8": 64 * 32}
    assert w.bits_per_weight == round(8 * (64 * 32 + 3 * 5) / (64 * 32), 2)  # three scale/zero point pairs
    cast = _graph([helper.make_node("Cast", ["W"], ["Wf"], to=1), helper.make_node("Mul", ["Wf", "ws"], ["Wd"]),
                   helper.make_node("MatMul", ["X", "Wd"], ["Y"])], {"W": q, "ws": scale}, tmp_path / "cast.onnx")
    w = _weights("onnx", cast)
    assert w.scheme == "int8 weights, Cast + Mul(scale)" and w.types == {"int8": 1}
    assert w.bits_per_weight == round(8 * (64 * 32 + 4) / (64 * 32), 2) == 8.02


def test_the_plan_reads_noise_from_own_weights_only_where_quantized(graphs):
    """--calibrate measures the noise on the candidate's own weights where its kind says they are quantized (an
    int8 graph), or rounded below the check's float32 (a float16 graph at --dtype float32); a float16 graph checked
    at float16, or a float32 one, keeps its dtype's noise (parity.checker.plan._quantized)."""
    from parity.checker.plan import _quantized

    onnx = get("onnx")
    assert _quantized(onnx, graphs["int8-dynamic"], {}, "float16") and _quantized(onnx, graphs["int4"], {}, "float32")
    assert not _quantized(onnx, graphs["float16"], {}, "float16") and _quantized(onnx, graphs["float16"], {}, "float32")
    assert not _quantized(onnx, graphs["float32"], {}, "float32")


# ---------------------------------------------------------------------------------------------------------------------
# Hugging Face checkpoints and neutral directories (fast: safetensors headers)


def test_a_checkpoint_says_its_dtypes_and_a_quantization_config_its_method(llama, tmp_path):
    w = _weights("transformers", llama / "llama")
    assert w.types == {"F32": 21} and w.bits_per_weight == 32.0 and not w.quantized and not w.rounded
    fp8 = tmp_path / "fp8"
    shutil.copytree(llama / "llama", fp8)
    config = json.loads((fp8 / "config.json").read_text())
    (fp8 / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "fp8"}}))
    w = _weights("transformers", fp8)
    assert w.quantized and w.scheme == "fp8" and w.bits_per_weight is None
    _cli("convert", llama / "llama", "--to", "neutral", "-o", tmp_path / "n", "--dtype", "bfloat16")
    w = _weights("neutral", tmp_path / "n")
    assert set(w.types) == {"BF16"} and w.bits_per_weight == 16.0 and w.rounded and not w.quantized


# ---------------------------------------------------------------------------------------------------------------------
# GGUF (engine: gguf-py writes F32, F16 and Q8_0; llama.cpp's quantizer the K-quant mixes)


@pytest.fixture(scope="module")
def gguf_files(llama):
    """made(source, qtype): ``parity convert --to gguf --gguf-type qtype`` of the tiny or wide Llama, once."""
    pytest.importorskip("gguf")
    made = {}

    def get_file(source: str, qtype: str) -> Path:
        if (source, qtype) not in made:
            made[source, qtype] = llama / f"{source}-{qtype}.gguf"
            _cli("convert", llama / source, "--to", "gguf", "-o", made[source, qtype], "--gguf-type", qtype)
        return made[source, qtype]

    return get_file


def _gguf_shapes(path) -> dict[str, tuple[str, int]]:
    """{tensor: (GGML type, elements)}, read by gguf-py's own reader."""
    import gguf

    return {t.name: (t.tensor_type.name, int(t.n_elements)) for t in gguf.GGUFReader(str(path)).tensors}


def test_gguf_q8_0_is_8_5_bits_on_its_matrices_and_the_norms_pull_the_rest(gguf_files):
    path = gguf_files("llama", "Q8_0")
    shapes = _gguf_shapes(path)
    matrices = sum(n for t, n in shapes.values() if t == "Q8_0")
    vectors = sum(n for t, n in shapes.values() if t == "F32")
    w = _weights("gguf", path)
    assert w.types == {"Q8_0": 16, "F32": 6} and w.parameters == {"Q8_0": matrices, "F32": vectors}
    assert 8 * 34 / 32 == 8.5  # a Q8_0 block: 32 int8 and a float16 scale
    assert w.bits_per_weight == round((8.5 * matrices + 32 * vectors) / (matrices + vectors), 2) == 8.57
    assert w.scheme == "Q8_0" and w.notes == () and w.words() == "quantized: Q8_0, 8.57 bits per weight"
    assert get("gguf").describe(path, {})["tensor_types"] == w.types


def test_gguf_float_files_are_not_quantized(gguf_files):
    w = _weights("gguf", gguf_files("llama", "F16"))
    assert w.types == {"F16": 16, "F32": 6} and w.scheme == "" and not w.quantized and w.rounded
    w = _weights("gguf", gguf_files("llama", "F32"))
    assert w.types == {"F32": 22} and w.bits_per_weight == 32.0 and not w.quantized and not w.rounded


def test_gguf_q4_k_m_names_its_mix_and_its_output(gguf_files):
    pytest.importorskip("llama_cpp")
    path = gguf_files("wide", "Q4_K_M")
    shapes = _gguf_shapes(path)
    w = _weights("gguf", path)
    # llama.cpp's mix (tests/test_gguf_quantize.py): output.weight, and layer 1's attn_v and ffn_down, in Q6_K
    assert w.scheme == "Q4_K_M" and w.types == {"Q4_K": 13, "Q6_K": 3, "F32": 6} and w.notes == ("Q6_K output",)
    blocks = {"Q4_K": 144 * 8 / 256, "Q6_K": 210 * 8 / 256, "F32": 32}  # bits per weight of each type's block
    assert blocks["Q4_K"] == 4.5 and blocks["Q6_K"] == 6.5625
    bits = sum(blocks[t] * n for t, n in shapes.values()) / sum(n for _, n in shapes.values())
    assert w.bits_per_weight == round(bits, 2) and 4.5 < w.bits_per_weight < 5.5
    assert w.words() == f"quantized: Q4_K_M (Q6_K output), {w.bits_per_weight:.3g} bits per weight"


def test_gguf_without_a_file_type_is_named_by_its_commonest_matrix_type(tmp_path):
    gguf = pytest.importorskip("gguf")
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(tmp_path / "bare.gguf"), "llama")
    for name in ("token_embd.weight", "blk.0.attn_q.weight", "blk.0.attn_k.weight"):
        q = gguf.quants.quantize(rng.standard_normal((64, 64), dtype=np.float32), gguf.GGMLQuantizationType.Q8_0)
        writer.add_tensor(name, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("output.weight", rng.standard_normal((64, 64), dtype=np.float32).astype(np.float16))
    writer.add_tensor("output_norm.weight", np.ones(64, dtype=np.float32))
    for step in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
        step()
    writer.close()
    w = _weights("gguf", tmp_path / "bare.gguf")
    assert w.scheme == "Q8_0" and w.types == {"Q8_0": 3, "F16": 1, "F32": 1} and w.notes == ("F16 output",)


def test_gguf_a_malformed_file_is_the_headers_one_line(gguf_files, tmp_path):
    from parity.engines.gguf.file import read_header

    cut = tmp_path / "cut.gguf"
    cut.write_bytes(gguf_files("llama", "Q8_0").read_bytes()[:5000])
    with pytest.raises(ParityError) as header:
        read_header(cut)
    with pytest.raises(ParityError) as weights:
        _weights("gguf", cut)
    assert str(weights.value) == str(header.value) and "\n" not in str(weights.value)


def test_real_qwen_q4_k_m_gguf():
    """The published Qwen2.5-Coder-0.5B Q4_K_M (../shared/models/qwen2.5-coder-0.5b.sh): its rows of 896 do not
    fit Q4_K's 256-weight blocks, so most matrices fell back to Q5_0; its output is Q8_0."""
    pytest.importorskip("gguf")
    if not (REAL / "model.gguf").is_file():
        pytest.skip(f"the real Qwen2.5-Coder GGUF is not at {REAL}: run ../shared/models/qwen2.5-coder-0.5b.sh "
                    f"(or set PARITY_REAL_QWEN)")
    w = _weights("gguf", REAL / "model.gguf")
    print(w.words())
    assert w.scheme == "Q4_K_M" and w.notes == ("Q8_0 output", "Q5_0 token embedding")
    assert w.types == {"Q5_0": 133, "Q8_0": 13, "Q6_K": 12, "Q4_K": 12, "F32": 121}
    assert 6.0 < w.bits_per_weight < 6.3


# ---------------------------------------------------------------------------------------------------------------------
# MLX, OpenVINO, CTranslate2 (engine): their conversions read back; a checkpoint's settings answered unconverted


def _converted(cache: Path, engine: str) -> list[str]:
    return sorted(p.name for p in (cache / "engines" / engine).glob("*")) if (cache / "engines" / engine).is_dir() \
        else []


def test_mlx_affine_4bit_is_5_bits_on_its_matrices(llama, engine_cache):
    pytest.importorskip("mlx_lm")
    from parity.engines.mlx.kind import conversion_settings, model_dir

    source = llama / "llama"
    w = _weights("mlx", source, {"bits": "4"})  # answered from the settings: nothing converted
    assert w.scheme == "affine 4-bit, groups of 64" and w.quantized and _converted(engine_cache, "mlx") == []
    assert _weights("mlx", source, {"bits": "8", "group_size": "32"}).scheme == "affine 8-bit, groups of 32"
    assert _weights("mlx", source, {"bits": "4", "mode": "mxfp4"}).scheme == "mxfp4 4-bit, groups of 32"
    plain = _weights("mlx", source, {"dtype": "float16"})
    assert plain.types == {"F16": 21} and not plain.quantized and _converted(engine_cache, "mlx") == []
    directory = model_dir(source, conversion_settings(source, {"bits": "4"}))
    w = _weights("mlx", directory)
    matrices, vectors = w.parameters["affine-4bit"], w.parameters["F32"]
    assert w.types == {"affine-4bit": 16, "F32": 5} and matrices == 106496 and vectors == 5 * 64
    assert 4 + 2 * 32 / 64 == 5.0  # 4 bits, and a float32 scale and bias per group of 64
    assert w.bits_per_weight == round((5.0 * matrices + 32 * vectors) / (matrices + vectors), 2)
    assert w.scheme == "affine 4-bit, groups of 64" and w.notes == ()
    assert get("mlx").describe(directory, {})["tensor_types"] == w.types


def test_openvino_nncf_int8_per_channel_and_int4_in_groups_of_128(llama, engine_cache):
    pytest.importorskip("nncf")
    from parity.engines.openvino.kind import checked, conversions, model_xml

    source = llama / "wide"
    w = _weights("openvino", source, {"weights": "int4"})  # no conversion cached: NNCF's mode by name
    assert w.scheme == "int4_asym" and w.quantized and conversions(source) == {}
    plain = _weights("openvino", source)
    assert plain.types == {"F32": 21} and not plain.quantized and conversions(source) == {}
    xml = model_xml(source, (), checked({"weights": "int4"}))
    w = _weights("openvino", xml.parent)
    assert _weights("openvino", source, {"weights": "int4"}) == w  # the cached conversion's IR, read
    assert w.scheme == "int4_asym, groups of 128" and w.types["u4"] == 14
    assert w.notes == ("2 u8 matrices",)  # NNCF keeps the embedding and the head in int8 (its backup mode)
    xml = model_xml(llama / "llama", (), checked({"weights": "int8"}))
    w = _weights("openvino", xml)
    assert w.scheme == "int8_asym, per channel" and w.types == {"u8": 16, "float32": 6}
    matrices, floats = w.parameters["u8"], w.parameters["float32"]
    rows = sum(s[0] for s in _rows(xml))  # a float16 scale and a u8 zero point per row
    assert w.bits_per_weight == round(8 * (matrices + 3 * rows + 4 * floats) / (matrices + floats), 2)


def _rows(xml: Path) -> list[tuple[int, ...]]:
    """The shapes of an IR's u8 weights (its Consts named after a module's weight)."""
    import xml.etree.ElementTree as ElementTree

    return [tuple(int(d) for d in layer.find("data").get("shape").split(","))
            for layer in ElementTree.parse(xml).getroot().iter("layer")
            if layer.get("type") == "Const" and layer.find("data").get("element_type") == "u8"
            and layer.get("name").endswith(".weight")]


def test_ctranslate2_int8_and_its_row_scales(llama, engine_cache):
    pytest.importorskip("ctranslate2")
    from parity.engines.ctranslate2.kind import convert

    source = llama / "llama"
    assert _weights("ctranslate2", source, {"quantization": "int8"}).scheme == "int8"
    half = _weights("ctranslate2", source, {"quantization": "float16"})
    assert half.types == {"F16": 21} and not half.quantized and half.rounded
    assert not _weights("ctranslate2", source).quantized and _converted(engine_cache, "ctranslate2") == []
    w = _weights("ctranslate2", convert(source, "int8"))
    matrices, vectors = w.parameters["int8"], w.parameters["F32"]
    assert w.scheme == "int8" and w.types == {"int8": 12, "F32": 5} and vectors == 5 * 64
    rows = 256 + 256 + 2 * (128 + 64 + 128 + 128 + 64)  # embeddings, projection; per layer fused qkv, o, gate, up, down
    assert w.bits_per_weight == round(8 * (matrices + 4 * rows + 4 * vectors) / (matrices + vectors), 2)
    # at the model's own compute type its activations are int8 too, which a reference on its weights does not do
    assert w.unemulated == "CTranslate2's int8 activations, compute_type default"
    assert _weights("ctranslate2", convert(source, "int8"), {"compute_type": "float32"}).unemulated == ""
    w = _weights("ctranslate2", convert(source, "int8_float16"))
    assert w.scheme == "int8_float16" and w.types == {"int8": 12, "F16": 5}
