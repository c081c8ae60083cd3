"""What the benchmarks share: Llama- and Gemma-3-shaped checkpoints with seeded random weights, written a tensor at
a time (so that making a 16 GB one needs little memory), and children whose wall time and own peak RSS are
measured."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from parity.storage.shards import PlannedTensor, ShardWriter, plan

ROOT = Path(__file__).resolve().parent.parent


def llama_config(shape: dict, dtype: torch.dtype) -> dict:
    """A Llama 3 config of the given shape (hidden_size, intermediate_size, num_hidden_layers, heads, head_dim,
    vocab_size, tie_word_embeddings)."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **shape, "hidden_act": "silu",
            "rms_norm_eps": 1e-5, "max_position_embeddings": 131072, "rope_theta": 500000.0,
            "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192},
            "attention_bias": False, "mlp_bias": False, "bos_token_id": 128000, "eos_token_id": 128001,
            "torch_dtype": str(dtype).removeprefix("torch.")}


def gemma3_config(shape: dict, dtype: torch.dtype) -> dict:
    """A Gemma 3 text config (Gemma3ForCausalLM) of the given shape (as llama_config, plus sliding_window and
    query_pre_attn_scalar), as google/gemma-3-270m's config.json writes it: every sixth layer global (RoPE base
    1e6), the others sliding (base 1e4), no softcaps, tanh-GELU, tied embeddings."""
    layers = shape["num_hidden_layers"]
    return {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", **shape,
            "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6, "max_position_embeddings": 32768,
            "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "rope_scaling": None,
            "layer_types": ["full_attention" if (j + 1) % 6 == 0 else "sliding_attention" for j in range(layers)],
            "_sliding_window_pattern": 6, "attention_bias": False, "attention_dropout": 0.0,
            "attn_logit_softcapping": None, "final_logit_softcapping": None, "use_bidirectional_attention": False,
            "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0, "torch_dtype": str(dtype).removeprefix("torch.")}


def checkpoint_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """The checkpoint's tensors (name -> shape) for a llama or gemma3_text config."""
    h, f, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    q, kv = config["num_attention_heads"] * config["head_dim"], config["num_key_value_heads"] * config["head_dim"]
    gemma = config["model_type"] == "gemma3_text"
    shapes = {"model.embed_tokens.weight": (v, h)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "self_attn.q_proj.weight": (q, h),
                       p + "self_attn.k_proj.weight": (kv, h), p + "self_attn.v_proj.weight": (kv, h),
                       p + "self_attn.o_proj.weight": (h, q), p + "post_attention_layernorm.weight": (h,),
                       p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
                       p + "mlp.down_proj.weight": (h, f)})
        if gemma:  # QK-norms and sandwich norms
            shapes.update({p + "self_attn.q_norm.weight": (config["head_dim"],),
                           p + "self_attn.k_norm.weight": (config["head_dim"],),
                           p + "pre_feedforward_layernorm.weight": (h,), p + "post_feedforward_layernorm.weight": (h,)})
    shapes["model.norm.weight"] = (h,)
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (v, h)
    return shapes


def make_checkpoint(directory: Path, config: dict, dtype: torch.dtype, shard_bytes: int = 5 * 10**9,
                    seed: int = 0) -> tuple[int, int]:
    """Write seeded random weights in shards of at most ``shard_bytes`` (with an index when there are several),
    each tensor generated a block of rows at a time; returns (bytes of weights, bytes of the largest tensor).
    Norm weights are near their identity: 1 + small noise, or small noise where the family scales by 1 + w."""
    shapes = checkpoint_shapes(config)
    norm_centre = 0.0 if config["model_type"] == "gemma3_text" else 1.0
    planned = [PlannedTensor(name, shape, dtype) for name, shape in shapes.items()]
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    shards = plan(planned, directory, max_shard_bytes=shard_bytes)
    gen = torch.Generator().manual_seed(seed)
    for shard in shards:
        writer = ShardWriter(shard)
        for t in shard.tensors:
            x = torch.empty(t.shape, dtype=dtype)
            for a in range(0, t.shape[0], 4096):  # float32 randoms a block of rows at a time
                block = torch.randn((min(4096, t.shape[0] - a), *t.shape[1:]), generator=gen)
                x[a:a + block.shape[0]] = block.mul_(0.05).add_(norm_centre) if len(t.shape) == 1 \
                    else block.mul_(0.02)
            writer.write(t.name, x)
        writer.close()
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(t.nbytes for t in planned)},
                 "weight_map": {t.name: s.path.name for s in shards for t in s.tensors}}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return sum(t.nbytes for t in planned), max(t.nbytes for t in planned)


# The child reports its own high-water mark as it exits (sys.exit included): VmHWM belongs to the process image
# after exec, while getrusage's maxrss would also count the pages the child shared with this parent at fork.
PEAK = ("import atexit, sys; atexit.register(lambda: print('VmHWM', next(l.split()[1] for l in "
        "open('/proc/self/status') if l.startswith('VmHWM')), file=sys.stderr, flush=True)); "
        "code = sys.argv[1]; sys.argv = sys.argv[1:]; exec(code)")


@dataclass
class Run:
    what: str
    wall: float           # seconds, the child's whole life (python start and imports included)
    peak: int             # bytes, the child's own peak RSS
    exit: int
    seconds: float | None  # what the child timed itself ("seconds N" on stdout), if it did
    cpu: float = 0.0       # seconds of CPU the child used, user and system, all its threads
    startup: float | None = None  # what the child reported as its start-up ("startup N": see STARTUP_LINE)
    stdout: str = ""

    @property
    def json(self):
        """The last line of the child's stdout that is a JSON object, parsed (None without one)."""
        import json

        line = next((x for x in reversed(self.stdout.splitlines()) if x.startswith("{")), None)
        return None if line is None else json.loads(line)


# A child's start-up: from just before it is spawned to the end of its imports. The parent puts the time of the
# spawn in this variable; a child that prints STARTUP_LINE after its imports reports it ("startup N").
SPAWNED = "PARITY_BENCH_SPAWNED"
STARTUP_LINE = "print('startup', time.time() - float(os.environ['PARITY_BENCH_SPAWNED']), flush=True)\n"


def run(code: str, what: str, *args: str, quiet: bool = False) -> Run:
    """Run python ``code`` (with ``args`` as sys.argv[1:]) in a child, after flushing dirty pages."""
    os.sync()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", PEAK, code, *args], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, SPAWNED: repr(time.time())})
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    kib = next((int(line.split()[1]) for line in done.stderr.splitlines() if line.startswith("VmHWM")), 0)
    seconds = next((float(line.split()[1]) for line in done.stdout.splitlines() if line.startswith("seconds ")), None)
    startup = next((float(line.split()[1]) for line in done.stdout.splitlines() if line.startswith("startup ")), None)
    result = Run(what, wall, kib * 1024, done.returncode, seconds, cpu_seconds(before, after), startup,
                 done.stdout)
    if done.returncode != 0:
        sys.stderr.write(done.stderr[-3000:])
    if not quiet:
        print(f"  {what}: {wall:.1f} s, peak RSS {result.peak / 2**30:.2f} GiB, exit {done.returncode}", flush=True)
    return result


def cpu_seconds(before: resource.struct_rusage, after: resource.struct_rusage) -> float:
    """User and system CPU seconds of the children waited for between two RUSAGE_CHILDREN readings."""
    return after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime


def cli(what: str, *args: str, quiet: bool = False) -> Run:
    """``parity ARGS`` in a child (python start and imports included in its wall time)."""
    return run("from parity.cli import cli; cli(sys.argv[1:], prog_name='parity')", what, *args, quiet=quiet)
