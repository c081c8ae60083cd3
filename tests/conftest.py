"""Shared fixtures: tiny checkpoints are built once per session, per family."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from parity.adapter import load_all
from parity.reference.tiny import make_tiny

FIXTURES = Path(__file__).parent / "fixtures"
ADAPTERS = load_all()
FAMILIES = sorted(ADAPTERS)


@pytest.fixture(scope="session")
def adapters():
    return ADAPTERS


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """tiny_dir(family) -> path of that family's tiny checkpoint (built on first use)."""
    root = tmp_path_factory.mktemp("tiny")
    built: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in built:
            built[family] = make_tiny(ADAPTERS[family], root / family)
        return built[family]

    return get


@pytest.fixture(scope="session")
def neutral_dir(tiny_dir, tmp_path_factory):
    """neutral_dir(family) -> that family's tiny checkpoint converted to the neutral layout (on first use)."""
    from parity.neutral.converter import convert

    root = tmp_path_factory.mktemp("neutral")
    built: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in built:
            convert(tiny_dir(family), root / family)
            built[family] = root / family
        return built[family]

    return get


def real_config(name: str) -> dict:
    return json.loads((FIXTURES / "configs" / name).read_text())


# ---------------------------------------------------------------------------------------------------------------------
# Test tiers (issue 31), assigned here and nowhere else. `python -m pytest -q` runs every tier (CI); the fast tier,
#     python -m pytest -q -m "not engine and not family and not real and not slow"
# runs in under five minutes on two cores (2m15s at a load average of 1.3) and still executes every module of
# parity/ (tests/test_tiers.py imports each with the engines absent). tests/test_tiers.py checks that every test file
# chooses its tier here: in TIERS, in NODE_TIERS (some of its tests) or in FAST. The markers (registered in
# pyproject.toml):
#   engine  needs an engine extra or a native build: llama.cpp's bindings / gguf-py, mlx / mlx-lm, openvino / nncf,
#           ctranslate2, transformer-lens, onnxruntime-genai (optimum: not installable beside transformers 5)
#   family  a per-family matrix: parametrized over every family (or every family an engine runs), the ops matrices,
#           the selftest over all families
#   real    needs a real model: Qwen2.5-Coder (PARITY_REAL_QWEN, ../shared/models) or all-MiniLM-L6-v2
#           (PARITY_REAL_MINILM, tests/models); skips when it is absent
#   slow    anything else over ~5 s on two cores that one-test-per-module coverage does not need

# a test file -> the markers of all its tests
TIERS: dict[str, set[str]] = {
    "test_ctranslate2.py": {"engine"},
    "test_gguf.py": {"engine"},
    "test_gguf_arithmetic.py": {"engine"},
    "test_gguf_quantize.py": {"engine"},
    "test_mlx.py": {"engine"},
    "test_openvino.py": {"engine"},
    "test_quantized_engines.py": {"engine"},
    "test_real_gguf.py": {"engine", "real"},
    "test_real_onnx.py": {"real"},
    "test_families.py": {"family"},
    "test_modes.py": {"family"},
    "test_ops_engines.py": {"family"},
    "test_ops_executor.py": {"family"},
    "test_ops_gguf.py": {"engine", "family"},
    "test_ops_transformers.py": {"family"},
}

# a node id glob (`*` the only wildcard; brackets are literal) -> markers of the tests it matches, where only some
# tests of a file are in a tier
NODE_TIERS: dict[str, set[str]] = {
    # engine: the tests that import an engine's package
    "tests/test_bad_inputs.py::*[gguf-file-cut-*": {"engine"},  # gguf-py writes and reads the file it cuts
    "tests/test_bad_inputs.py::*[gguf-magic-*": {"engine"},
    "tests/test_bad_inputs.py::*[gguf-header-*": {"engine"},
    "tests/test_bad_inputs.py::*[gguf-metadata-*": {"engine"},
    "tests/test_bad_inputs.py::*[gguf-tensor-*": {"engine"},
    "tests/test_bad_inputs.py::*[gguf-file-of-an-architecture-*": {"engine"},
    "tests/test_drilldown.py::*_on_a_gguf_candidate*": {"engine"},
    "tests/test_onnx.py::test_onnxruntime_genai_model_builder": {"engine"},
    "tests/test_onnx.py::test_optimum_onnx_export": {"engine"},
    "tests/test_ops_engines.py::test_openvino_*": {"engine"},
    "tests/test_ops_engines.py::test_mlx_*": {"engine"},
    "tests/test_ops_gguf.py::test_real_qwen_*": {"real"},
    "tests/test_python_engine.py::test_transformer_lens_*": {"engine"},
    "tests/test_python_engine.py::test_isolated_the_mistake_is_in_every_attention_and_no_mlp": {"engine"},
    "tests/test_python_engine.py::test_not_a_python_file_and_an_unknown_entry": {"engine"},
    "tests/test_weights_kinds.py::test_gguf_*": {"engine"},
    "tests/test_weights_kinds.py::test_mlx_*": {"engine"},
    "tests/test_weights_kinds.py::test_openvino_*": {"engine"},
    "tests/test_weights_kinds.py::test_ctranslate2_*": {"engine"},
    "tests/test_weights_kinds.py::test_real_*": {"engine", "real"},
    # family: the tests of a file otherwise outside the matrices parametrized over every family (or every family an
    # engine runs), and the selftest over all families
    "tests/test_bugs.py::test_selftest_matrix_totals": {"family"},
    "tests/test_check.py::test_every_family_passes_in_float32[*": {"family"},
    "tests/test_check.py::test_every_family_passes_in_bfloat16_with_calibration[*": {"family"},
    "tests/test_ctranslate2.py::test_converted_by_ctranslate2_the_logits_pass[*": {"family"},
    "tests/test_decode.py::test_decode_32_passes_with_the_executor_and_transformers_caches[*": {"family"},
    "tests/test_decode.py::test_decode_32_passes_with_parity_own_onnx_export_with_cache[*": {"family"},
    "tests/test_executor.py::test_every_capture_point_matches_transformers_in_float32[*": {"family"},
    "tests/test_executor.py::test_low_precision_is_as_close_to_transformers_as_the_dtype_itself_allows[*": {"family"},
    "tests/test_executor.py::test_rope_style_round_trip_still_matches[*": {"family"},
    "tests/test_gguf.py::test_f32_gguf_passes_layerwise_in_llama_cpp[*": {"family"},
    "tests/test_golden.py::test_round_trip_golden_dump_check[*": {"family"},
    "tests/test_golden.py::test_a_golden_gives_the_live_checks_report[*": {"family"},
    "tests/test_golden.py::test_installed_transformers_reproduces_the_committed_golden[*": {"family"},
    "tests/test_hf_kernels.py::test_sdpa_matches_eager[*": {"family"},
    "tests/test_mlx.py::test_converted_by_mlx_lm_passes_layerwise[*": {"family"},
    "tests/test_onnx.py::test_every_family_exported_with_debug_outputs_passes_in_float32[*": {"family"},
    "tests/test_onnx.py::test_every_family_exported_in_float16_passes_with_calibration[*": {"family"},
    "tests/test_openvino.py::test_converted_checkpoint_passes_layerwise_at_f32[*": {"family"},
    "tests/test_rope.py::test_tiny_config_tables_match_transformers[*": {"family"},
    "tests/test_streaming.py::test_streamed_reference_is_transformers_bit_for_bit[*": {"family"},
    # family: a model no adapter knows (tests/test_generic.py), over the architectures and over every causal
    # LM transformers lists; gpt_neox stays in the fast tier
    "tests/test_generic.py::test_self_passes_and_a_scaled_attention_projection_fails_in_layer_1[cohere]": {"family"},
    "tests/test_generic.py::test_self_passes_and_a_scaled_attention_projection_fails_in_layer_1[granite]": {"family"},
    "tests/test_generic.py::test_self_passes_and_a_scaled_attention_projection_fails_in_layer_1[gpt_oss]": {"family"},
    "tests/test_generic.py::test_self_passes_and_a_scaled_attention_projection_fails_in_layer_1[starcoder2]": {"family"},
    "tests/test_generic.py::test_self_passes_and_a_scaled_attention_projection_fails_in_layer_1[falcon]": {"family"},
    "tests/test_generic.py::test_self_passes_and_a_scaled_attention_projection_fails_in_layer_1[stablelm]": {"family"},
    "tests/test_generic.py::test_self_passes_and_a_scaled_attention_projection_fails_in_layer_1[phi]": {"family"},
    "tests/test_generic.py::test_every_causal_lm_transformers_lists[*": {"family", "slow"},
    "tests/test_generic.py::test_hybrids_check_layer_by_layer_and_decode[*": {"family"},
    "tests/test_generic.py::test_an_onnx_export_of_a_model_no_adapter_knows": {"engine"},
    "tests/test_generic.py::test_openvino_converts_a_model_no_adapter_knows": {"engine"},
    # slow: over ~5 s on two cores, a module each keeps quicker tests of (seconds measured at a load average of 4)
    "tests/test_bugs.py::test_a_broken_onnx_export_is_caught_and_named": {"slow"},  # 8 s
    "tests/test_decode.py::test_an_onnx_export_refuses_a_cache_it_cannot_have": {"slow"},  # 9 s
    "tests/test_decode.py::test_the_executor_cache_equals_its_uncached_forward_at_every_position": {"slow"},  # 6 s
    "tests/test_decode.py::test_reports_carry_the_step_axis": {"slow"},  # 6 s
    "tests/test_decode.py::test_a_golden_with_decode_steps_checks_an_engine_dump_with_steps_from_the_c_writer": {"slow"},
    "tests/test_decode.py::test_each_cache_bug_fails_at_its_step_and_is_named[gemma*": {"slow"},  # 4-7 s each
    "tests/test_decode.py::test_each_cache_bug_fails_at_its_step_and_is_named[qwen3-*": {"slow"},
    "tests/test_decode.py::test_each_cache_bug_fails_at_its_step_and_is_named[mistral-*": {"slow"},
    "tests/test_decode.py::test_each_cache_bug_fails_at_its_step_and_is_named[gpt2-*": {"slow"},
    "tests/test_decode.py::test_what_cannot_decode_is_refused_with_exit_2": {"slow"},  # 6 s
    "tests/test_drilldown.py::test_located_in_parity_onnx_export_with_op_outputs": {"slow"},  # 9 s
    "tests/test_fuzz.py::test_corrupted_safetensors_indexes": {"slow"},  # 6 s
    "tests/test_fuzz.py::test_corrupted_configs": {"slow"},  # 9 s
    "tests/test_hf_kernels.py::test_flex_attention_matches_eager[*": {"slow"},  # 5-32 s each
    "tests/test_hf_kernels.py::test_compile_runs_compiled_code_with_hooks": {"slow"},  # 15 s
    "tests/test_hf_kernels.py::test_compile_with_sdpa": {"slow"},  # 6 s
    "tests/test_interrupts.py::test_ctrl_c_ends_a_check_in_every_phase[the *": {"slow"},  # 6-7 s each
    "tests/test_interrupts.py::test_ctrl_c_ends_a_check_in_every_phase[a long generation]": {"slow"},
    "tests/test_interrupts.py::test_ctrl_c_ends_a_check_in_every_phase[writing the report]": {"slow"},
    "tests/test_interrupts.py::test_a_signal_at_any_moment_ends_the_command[*": {"slow"},  # 10-40 s each
    "tests/test_moe_families.py::test_a_qwen3_moe_checkpoint_with_norm_topk_prob_flipped_fails_at_the_first_moe_mlp_out":
        {"slow"},  # 5 s
    # tests/test_onnx.py's `exported` starts all 32 exports on first use (two processes, in order: 14 families in
    # float32, in float16, 4 torch.onnx exports) and cancels what has not started when the module ends: its tests
    # wait for the 1st (30 s: test_the_exported_file) to the 32nd (2-4 min). parity's ONNX export runs in the fast
    # tier in tests/test_onnx_quant.py.
    "tests/test_onnx.py::test_the_exported_file": {"slow"},
    "tests/test_onnx.py::test_the_cli_convert_is_atomic_and_external_data_is_used_past_the_limit": {"slow"},  # 15 s
    "tests/test_onnx.py::test_norms_compute_in_float32_inside_a_float16_graph": {"slow"},
    "tests/test_onnx.py::test_a_broken_export_fails_at_the_right_point": {"slow"},
    "tests/test_onnx.py::test_generation_and_a_final_only_check": {"slow"},
    "tests/test_onnx.py::test_onnx_options_and_refusals": {"slow"},
    "tests/test_onnx.py::test_a_torch_onnx_export_of_the_transformers_model_is_matched_by_module_path[*": {"slow"},
    "tests/test_onnx.py::test_without_module_paths_points_are_found_by_structure[*": {"slow"},
    "tests/test_onnx.py::test_with_nothing_matched_the_final_output_is_still_compared_and_map_names_values": {"slow"},
    "tests/test_onnx.py::test_a_broken_torch_onnx_export_fails_at_the_right_point": {"slow"},
    "tests/test_onnx_quant.py::test_a_correct_quantized_export_passes_at_onnxruntimes_arithmetic[qwen2-*": {"slow"},
    "tests/test_onnx_quant.py::test_a_correct_quantized_export_passes_at_onnxruntimes_arithmetic[gemma-*": {"slow"},
    "tests/test_onnx_quant.py::test_a_correct_quantized_export_passes_at_onnxruntimes_arithmetic[llama-qdq]": {"slow"},
    "tests/test_onnx_quant.py::test_a_correct_quantized_export_passes_at_onnxruntimes_arithmetic[llama-int4*": {"slow"},
    "tests/test_onnx_quant.py::test_a_broken_twin_fails_where_its_mistake_acts_and_is_named[*": {"slow"},  # 6 s each
    # one third-party graph, its swapped twin and the refusals stay fast (the two exports: 8 s); the other 7 are slow
    "tests/test_onnx_foreign.py::test_a_third_party_quantized_export_passes[bert-*": {"slow"},
    "tests/test_onnx_foreign.py::test_a_third_party_quantized_export_passes[llama-q*": {"slow"},
    "tests/test_onnx_foreign.py::test_a_third_party_quantized_export_passes[llama-int4]": {"slow"},
    "tests/test_readme.py::test_readme_selftest_rows_are_what_a_run_produces": {"slow"},  # 67 s: selftest of 3 families
    # the gate on an int8 export stays fast (8 s: the default's two passes and the gate); the rest are slow
    "tests/test_quantized.py::test_a_correct_int8_export_passes_with_no_flag_and_its_cost_is_reported": {"slow"},
    "tests/test_quantized.py::test_a_broken_int8_export_fails_with_no_flag_and_is_named": {"slow"},  # 15 s
    "tests/test_quantized.py::test_a_float_candidate_is_checked_as_it_always_was": {"slow"},  # 11 s
    "tests/test_rope.py::test_real_config_tables_match_transformers[*": {"slow"},  # 14 s for the 12 configs
}

# the test files whose tests are all in the fast tier, deliberately (the rest of tests/test_*.py is in TIERS or has
# a pattern in NODE_TIERS)
FAST: set[str] = {
    "test_adapter_extends.py", "test_adapter_schema.py", "test_alt_layouts.py", "test_bert_variants.py",
    "test_candidates.py", "test_cli.py", "test_compare_chunks.py", "test_convert.py", "test_convert_single_pass.py",
    "test_convert_without_torch.py", "test_deepseek_v3_variants.py", "test_design_table.py", "test_docs_commands.py",
    "test_dumps.py", "test_fp8.py", "test_gemma2_variants.py", "test_gemma3_variants.py", "test_gemma4_variants.py",
    "test_gemma_variants.py", "test_glm4_moe_variants.py", "test_gpt2_variants.py", "test_gpt_neox_variants.py",
    "test_held_out_ports.py", "test_input_ids.py",
    "test_layers.py", "test_layouts.py", "test_lengths.py",
    "test_moe_mla.py", "test_neutral_model.py", "test_options.py", "test_properties.py", "test_readers.py",
    "test_real_configs.py", "test_recognition.py",
    "test_render.py", "test_saved_buffers.py", "test_slices.py", "test_sliding_window.py", "test_spill.py",
    "test_tiers.py", "test_tp_dumps.py",
}

MARKERS = ("engine", "family", "real", "slow")
# the patterns that matched a collected test in this session, and the files collected whole (tests/test_tiers.py)
MATCHED: set[str] = set()
COLLECTED: set[str] = set()


def _glob(pattern: str) -> re.Pattern:
    return re.compile(".*".join(re.escape(part) for part in pattern.split("*")))


_NODE_GLOBS = [(_glob(p), p, marks) for p, marks in NODE_TIERS.items()]


def tiers_of(nodeid: str) -> set[str]:
    """The markers TIERS and NODE_TIERS give the test ``nodeid`` (``tests/test_x.py::name[params]``)."""
    marks = set(TIERS.get(nodeid.split("::", 1)[0].rsplit("/", 1)[-1], ()))
    for glob, pattern, more in _NODE_GLOBS:
        if glob.fullmatch(nodeid):
            marks |= more
            MATCHED.add(pattern)
    return marks


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    narrowed = {arg.split("::", 1)[0].rsplit("/", 1)[-1] for arg in config.args if "::" in arg}  # some tests
    for item in items:
        if item.path.name not in narrowed:
            COLLECTED.add(item.nodeid.split("::", 1)[0])
        for mark in sorted(tiers_of(item.nodeid)):
            item.add_marker(getattr(pytest.mark, mark))
