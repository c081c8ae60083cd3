"""What the benchmarks share: Llama- and Gemma-3-shaped checkpoints with seeded random weights, written a tensor at
a time (so that making a 16 GB one needs little memory), and children whose wall time and own peak RSS are
measured."""

from __future__ import annotations

import json
import os
import random
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



# a tokenizer's pieces: SentencePiece's space and letters of one, two and three bytes in UTF-8, as a multilingual
# vocabulary's
SPACE = "\u2581"
LETTERS = "abcdefghijklmnopqrstuvwxyz\u00e0\u00e9\u00e8\u00e7\u00f1\u00fc\u00f6\u00df\u4e00\u4e2d\u5927\u6709\u4eba"
GEMMA_SPECIAL = ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>")  # ids 0 to 4, as gemma3_config's


def write_tokenizer(directory: Path, vocab_size: int, seed: int = 0) -> int:
    """A tokenizer of Gemma 3's kind and size in ``directory`` (tokenizer.json, tokenizer_config.json): BPE with
    byte fallback over ``vocab_size`` pieces, spaces written as SentencePiece's U+2581, <bos> put before each
    text. Its pieces are seeded random, each beyond the letters an earlier piece and a letter; a merge makes
    each of them from each of its splits into two pieces. Returns tokenizer.json's size in bytes."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors

    rng = random.Random(seed)
    pieces = [*GEMMA_SPECIAL, *(f"<0x{b:02X}>" for b in range(256)), SPACE, *LETTERS]
    pieces += [SPACE + c for c in LETTERS]  # every letter after a space is a piece: a word of one token
    known = set(pieces)
    grown = pieces[len(GEMMA_SPECIAL) + 256:]  # what a merge extends: not the special or byte pieces
    while len(pieces) < vocab_size:
        piece = rng.choice(grown) + rng.choice(LETTERS)
        if piece not in known:
            known.add(piece)
            pieces.append(piece)
            grown.append(piece)
    merges = []  # as in SentencePiece's BPE converted to tokenizer.json: ordered by the piece they make
    for piece in grown[len(LETTERS) + 1:]:
        merges += [(piece[:k], piece[k:]) for k in range(len(piece) - 1, 0, -1)
                   if piece[:k] in known and piece[k:] in known]
    tok = Tokenizer(models.BPE({p: i for i, p in enumerate(pieces)}, merges, unk_token="<unk>", fuse_unk=True,
                               byte_fallback=True))
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in GEMMA_SPECIAL])
    tok.normalizer = normalizers.Replace(" ", SPACE)
    tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A $B",
                                                       special_tokens=[("<bos>", 2)])
    tok.save(str(directory / "tokenizer.json"))
    config = {"add_bos_token": True, "add_eos_token": False, "bos_token": "<bos>", "eos_token": "<eos>",
              "pad_token": "<pad>", "unk_token": "<unk>", "mask_token": "<mask>", "tokenizer_class": "GemmaTokenizer",
              "model_max_length": 1000000000000000019884624838656, "clean_up_tokenization_spaces": False,
              "spaces_between_special_tokens": False,
              "added_tokens_decoder": {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                                "single_word": False, "special": True}
                                       for i, t in enumerate(GEMMA_SPECIAL)}}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return (directory / "tokenizer.json").stat().st_size


def prompt_of(directory: Path, tokens: int, seed: int = 0) -> str:
    """A text that ``directory``'s tokenizer encodes as exactly ``tokens`` ids (its <bos> included): seeded random
    words of 2 to 10 letters, each a few pieces, then one-letter words (one piece each) to make up the count."""
    from tokenizers import Tokenizer

    tok, rng = Tokenizer.from_file(str(directory / "tokenizer.json")), random.Random(seed)
    words: list[str] = []
    while True:
        word = "".join(rng.choice(LETTERS) for _ in range(rng.randint(2, 10)))
        if len(tok.encode(" ".join([*words, word])).ids) > tokens:
            break
        words.append(word)
    words += ["a"] * (tokens - len(tok.encode(" ".join(words)).ids))
    text = " ".join(words)
    assert len(tok.encode(text).ids) == tokens, "a one-letter word is not one piece"
    return text

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
