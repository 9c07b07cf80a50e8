"""DeepSeek-V4.1 checkpoints in DeepSeek's published layout: safetensors under the reference's own tensor names (FP8
32x32 E8M0 dense weights with `<name>.scale`, MXFP4 routed experts as int8/uint8 bytes, FP8 Engram tables with a
per-32 E8M0 scale per row; bf16 checkpoints too), and `tokenizer.json`, whose compressed token map feeds Engram:
which modules are stored quantized, loading with expert parallelism, random weights of a working shape. The
inverse (writing the published layout) is `writer.py`.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Iterable

import torch

from openinfer.layers.engram import EngramLayout, NgramHasher, compressed_token_map
from openinfer.models.deepseek_v4.model import Experts
from openinfer.models.deepseek_v41.config import DeepseekV41Config
from openinfer.models.deepseek_v41.model import DeepseekV41ForCausalLM
from openinfer.quantization.checkpoint import QuantScheme, pair_quantized
from openinfer.quantization.formats import FP8_MAX, float_to_e8m0, pow2_ceil

V41_BLOCK = 32            # the released V4.1 weights: 32x32 FP8 blocks (inference form has no quantization_config)
_EXPERT = re.compile(r"^(.*\.ffn\.experts)\.(\d+)\.(w1|w2|w3)\.(weight|scale)$")
# the shared expert's w1 / w3 (or their scales): the halves of our stacked `w13` (model.Expert), in that order
_SHARED_PART = re.compile(r"^(.*\.shared_experts)\.(w1|w3)\.(weight|scale)$")
_SHARED_STACK = re.compile(r"^(.*\.shared_experts)\.w13\.(weight|weight_scale)$")
# an attention's wq_a / wkv (or their scales): the parts of its `wq_a_kv` where the model joined them at load
# (`join_projections`; else they load as themselves)
_JOINED_PART = re.compile(r"^(.*\.attn)\.(wq_a|wkv)\.(weight|scale)$")
_JOINED_STACK = re.compile(r"^(.*\.attn)\.wq_a_kv\.(weight|weight_scale)$")
_PART_INDEX = {"w1": 0, "w3": 1, "wq_a": 0, "wkv": 1}       # a part's place among its stacked linear's parts
_ENGRAM_TABLE = re.compile(r"\.engram\.embed\.(weight|scale)$")
_SHARED_WITH_BACKBONE = re.compile(r"^mtp\.\d+\.(embed|head)\.weight$")     # DSpark stages' copies


def quant_scheme(hf: dict, cfg: DeepseekV41Config) -> QuantScheme | None:
    if hf.get("quantization_config") is not None:
        return QuantScheme.from_hf(hf)
    if cfg.dtype == "fp8" or cfg.expert_dtype is not None:
        return QuantScheme(V41_BLOCK, {"fp4": "mxfp4", "fp8": "fp8", None: "fp8"}[cfg.expert_dtype])
    return None


def engram_hasher(cfg: DeepseekV41Config, model_dir: Path) -> tuple[EngramLayout, NgramHasher] | None:
    """Engram's layout and n-gram hasher; the hasher's compressed token map comes from the directory's tokenizer
    and must have the size the config was trained with (every hash multiplier derives from it)."""
    if not cfg.engram_layer_ids:
        return None
    layout = EngramLayout.build(cfg.engram_layer_ids, cfg.engram_max_ngram_size, cfg.engram_n_heads,
                                cfg.engram_head_dim, cfg.engram_vocab_size, cfg.engram_num_embeddings)
    tok_file = model_dir / "tokenizer.json"
    if not tok_file.is_file():
        raise ValueError(f"{model_dir}: DeepSeek-V4.1 Engram layers hash the tokenizer's compressed token map, but "
                         f"there is no tokenizer.json")
    stat = tok_file.stat()
    token_map, size = _token_map(str(tok_file.resolve()), stat.st_mtime_ns, stat.st_size)
    if size != cfg.engram_compressed_vocab_size:
        raise ValueError(f"{model_dir}: the tokenizer's compressed vocabulary has {size} entries but the config's "
                         f"engram_compressed_vocab_size is {cfg.engram_compressed_vocab_size} (a different tokenizer: "
                         f"every Engram hash would change)")
    return layout, NgramHasher(layout, token_map, size, cfg.engram_pad_id)


@functools.lru_cache(maxsize=4)
def _token_map(path: str, mtime_ns: int, size: int) -> tuple[torch.Tensor, int]:
    """The compressed token map of a tokenizer file (about a second for 129K tokens; kept per file version, so
    engines of one process share it)."""
    from tokenizers import Tokenizer

    return compressed_token_map(Tokenizer.from_file(path))


def stored_modules(headers: dict, scheme: QuantScheme | None) -> tuple[list[str], dict[str, str]]:
    """(FP8 linears, expert stacks -> format) as the checkpoint stores them (Engram tables are FP8 by design,
    read as tables, not as linears)."""
    linears = {n: t for n, t in headers.items() if not _ENGRAM_TABLE.search(n)}
    pairs = pair_quantized(linears, scheme, is_expert=lambda n: _EXPERT.match(n) is not None)
    fp8, experts = [], {}
    for name, q in pairs.items():
        m = _EXPERT.match(name)
        if m:
            stack = m.group(1)
            if experts.setdefault(stack, q.fmt) != q.fmt:
                raise ValueError(f"{stack} mixes {experts[stack]} and {q.fmt} experts ({name!r})")
        else:
            module = _SHARED_PART.sub(r"\1.w13.weight", name).removesuffix(".weight")
            if module not in fp8:       # (w1 and w3: the one stacked w13)
                fp8.append(module)
    return fp8, experts


def published_modules(model: DeepseekV41ForCausalLM, scheme: QuantScheme | None) -> tuple[list[str], dict[str, str]]:
    """What DeepSeek publishes quantized under `scheme`: every linear the reference builds in the default dtype
    (attention projections, the indexer's wq_b, shared experts, Engram's wkv, DSpark's main_proj) in FP8, the
    routed experts in the expert format; bf16: wo_a, the compressors, weights_proj, wk, the router, heads."""
    if scheme is None:
        return [], {}
    fp8_names = re.compile(r"(\.attn\.(wq_a|wq_b|wkv|wo_b)|\.indexer\.wq_b|\.shared_experts\.w(13|2)|\.engram\.wkv"
                           r"|^mtp\.0\.main_proj)$")
    fp8 = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and fp8_names.search(n)]
    experts = {n: scheme.expert_fmt for n, m in model.named_modules() if isinstance(m, Experts)}
    return fp8, experts


def checkpoint_to_param(name: str) -> tuple[str, tuple[int | None, str] | None]:
    """Our parameter for a checkpoint tensor (and (expert, w1|w2|w3) for one expert's slice of a stack; (None,
    w1|w3) for a half of the shared expert's stacked w13)."""
    m = _EXPERT.match(name)
    if m:
        stack = m.group(1) + (".down_proj" if m.group(3) == "w2" else ".gate_up_proj")
        return stack + ("_scale" if m.group(4) == "scale" else ""), (int(m.group(2)), m.group(3))
    m = _SHARED_PART.match(name)
    if m:
        return m.group(1) + (".w13.weight_scale" if m.group(3) == "scale" else ".w13.weight"), (None, m.group(2))
    if name.endswith(".scale") and not _ENGRAM_TABLE.search(name):
        return name[:-len(".scale")] + ".weight_scale", None
    return name, None


def _local_slots(model: DeepseekV41ForCausalLM) -> dict[int, list[int]] | None:
    """Expert parallelism: checkpoint expert e -> this rank's slots of every backbone stack holding it; None: every
    stack holds all its experts (one process, and always the DSpark stages)."""
    if model.expert_placement is None:
        return None
    from openinfer.distributed.expert_parallel import checkpoint_slots

    return checkpoint_slots(model.expert_placement, model.parallel.ep_rank)


def _ep_stack(model: DeepseekV41ForCausalLM, name: str) -> bool:
    """Whether parameter (or checkpoint tensor) `name` belongs to an expert-parallel stack: a backbone layer's
    experts under expert parallelism."""
    return model.expert_placement is not None and name.startswith("layers.") and ".ffn.experts." in name


def model_keeps(model: DeepseekV41ForCausalLM):
    """A name filter for reading the checkpoint: with expert parallelism the backbone experts other ranks hold
    are never read from disk; None: read everything."""
    local = _local_slots(model)
    if local is None:
        return None

    def keep(name: str) -> bool:
        m = _EXPERT.match(name)
        return m is None or not _ep_stack(model, name) or int(m.group(2)) in local
    return keep


def load_weights(model: DeepseekV41ForCausalLM, weights: Iterable[tuple[str, torch.Tensor]],
                 dry_run: bool = False) -> None:
    """(`model`: the whole model, or its vision tower alone, `image_encoder.ImageEncoder`, which holds the checkpoint's
    tower tensors under the same names.) Every parameter covered exactly once, shapes and stored formats checked (quantized tensors are copied as
    bytes, never read as floats). The DSpark stages' `embed`/`head` copies must equal the backbone's. With expert
    parallelism a backbone expert goes to this rank's slots holding it (none: skipped); the loading pass needs this
    rank's experts only (`model_keeps` leaves the others unread), the `dry_run` over the headers all of them."""
    params = dict(model.named_parameters())
    local = _local_slots(model)
    n_routed = model.config.n_routed_experts

    def num_experts(name: str, stack: torch.Tensor) -> int:
        return n_routed if _ep_stack(model, name) else stack.shape[0]

    def expected_experts(name: str, stack: torch.Tensor):
        return local.keys() if _ep_stack(model, name) and not dry_run else range(num_experts(name, stack))

    loaded, shared = set(), []
    for ckpt_name, tensor in weights:
        if _SHARED_WITH_BACKBONE.match(ckpt_name):
            shared.append((ckpt_name, tensor))
            continue
        name, part = checkpoint_to_param(ckpt_name)
        m = _JOINED_PART.match(ckpt_name)
        if m and f"{m.group(1)}.wq_a_kv.weight" in params:
            name = f"{m.group(1)}.wq_a_kv.{'weight_scale' if m.group(3) == 'scale' else 'weight'}"
            part = (None, m.group(2))
        if name not in params:
            raise ValueError(f"checkpoint tensor {ckpt_name!r} has no place in {type(model).__name__}")
        dsts = [params[name].data]
        key = name
        if part is not None and part[0] is None:    # a part of a stacked linear (the shared expert's w13, wq_a_kv)
            w, i = part[1], _PART_INDEX[part[1]]
            module_name, _, leaf = name.rpartition(".")
            rows = model.get_submodule(module_name).part_rows(leaf)
            dsts = [dsts[0][sum(rows[:i]):sum(rows[:i + 1])]]
            key = f"{name}#{w}"
        elif part is not None:
            e, w = part
            stack = dsts[0]
            n = num_experts(name, stack)
            if e >= n:
                raise ValueError(f"checkpoint expert {e} of {ckpt_name!r} is beyond the layer's {n} experts")
            half = stack.shape[1] // 2
            slots = local.get(e, []) if _ep_stack(model, name) else [e]
            dsts = [stack[i] if w == "w2" else stack[i, :half] if w == "w1" else stack[i, half:] for i in slots]
            key = f"{name}#{e}.{w}"
        raw = tensor.dtype in (torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.int8, torch.uint8)
        for dst in dsts:
            if raw != (dst.dtype.itemsize == 1):
                raise ValueError(f"checkpoint tensor {ckpt_name!r} is stored {tensor.dtype} but its place holds "
                                 f"{dst.dtype}: one module, one format, and quantized weights are never read as "
                                 f"floats")
            if tuple(dst.shape) != tuple(tensor.shape):
                raise ValueError(f"checkpoint tensor {ckpt_name!r} has shape {tuple(tensor.shape)}, expected "
                                 f"{tuple(dst.shape)}")
        if key in loaded:
            raise ValueError(f"checkpoint tensor {ckpt_name!r} is stored twice")
        if not dry_run:
            for dst in dsts:
                dst.copy_(tensor.view(dst.dtype) if raw else tensor.to(dst.dtype))
        loaded.add(key)
    expected = set()
    for n, p in params.items():
        if n.endswith(("experts.gate_up_proj", "experts.gate_up_proj_scale")):
            expected |= {f"{n}#{e}.{w}" for e in expected_experts(n, p) for w in ("w1", "w3")}
        elif n.endswith(("experts.down_proj", "experts.down_proj_scale")):
            expected |= {f"{n}#{e}.w2" for e in expected_experts(n, p)}
        elif _SHARED_STACK.match(n):
            expected |= {f"{n}#w1", f"{n}#w3"}
        elif _JOINED_STACK.match(n):
            expected |= {f"{n}#wq_a", f"{n}#wkv"}
        else:
            expected.add(n)
    missing = sorted(expected - loaded)
    if missing:
        engram = [m for m in missing if ".engram.embed." in m]
        if engram:
            raise ValueError(f"checkpoint lacks the Engram tables {engram[:4]} (one FP8 table + scale per Engram "
                             f"layer, {model.config.engram_num_embeddings} rows)")
        raise ValueError(f"checkpoint lacks {len(missing)} tensor(s), e.g. {missing[:5]}")
    for ckpt_name, tensor in shared:
        own = params["embed.weight" if ckpt_name.endswith("embed.weight") else "head.weight"]
        if tuple(tensor.shape) != tuple(own.shape):
            raise ValueError(f"checkpoint tensor {ckpt_name!r} has shape {tuple(tensor.shape)}, but the backbone's "
                             f"is {tuple(own.shape)} (DSpark stages share the backbone's embedding and head)")
        if not dry_run and not torch.equal(tensor.to(own.device, own.dtype), own.data):
            raise ValueError(f"checkpoint tensor {ckpt_name!r} differs from the backbone's: DSpark stages share the "
                             f"backbone's embedding and head, separate copies are not supported")


def init_random(model: DeepseekV41ForCausalLM, seed: int, std: float = 0.02) -> None:
    """Random weights of a working shape (for `load_format="dummy"` and the tiny model): normal(std) matrices,
    norms and mHC scales at one, small random sinks / mHC biases / router bias; quantized weights get random
    stored values (FP8 values, E2M1 nibbles) with one power-of-two scale giving about the same std; Engram tables
    random FP8 rows."""
    dev = next(model.parameters()).device
    gen = torch.Generator(device=dev).manual_seed(seed)
    fp8_std, e2m1_std = 16.0, 2.93     # of randn*16 cast to E4M3, and of uniformly random E2M1 codes
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dtype == torch.float8_e8m0fnu:
                owner = model.get_submodule(name.rsplit(".", 1)[0])
                fmt = "mxfp4" if getattr(owner, "fmt", "fp8") == "mxfp4" else "fp8"
                table = name.endswith("engram.embed.scale")
                target = 0.5 if table else std
                byte = float_to_e8m0(pow2_ceil(torch.tensor(target / (e2m1_std if fmt == "mxfp4" else fp8_std))))
                p.view(torch.uint8).fill_(int(byte.view(torch.uint8)))
            elif p.dtype == torch.uint8:
                p.copy_(torch.randint(0, 256, p.shape, generator=gen, device=dev, dtype=torch.uint8))
            elif p.dtype == torch.float8_e4m3fn:
                step = max(1, (64 << 20) // max(p[0].numel(), 1))
                for i in range(0, p.shape[0], step):
                    part = p[i:i + step]
                    part.copy_((torch.randn(part.shape, generator=gen, device=dev, dtype=torch.bfloat16) * fp8_std)
                               .clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn))
            elif name.endswith(("norm.weight", "norm1.weight", "norm2.weight", "_scale", "q_weight", "k_weight")):
                p.fill_(1.0)
            elif name.endswith(("attn_sink", "_base")):
                p.copy_(torch.randn(p.shape, generator=gen, device=dev) * 0.5)
            elif name.endswith(("gate.bias", "gate.bias_vl")):
                p.copy_(torch.randn(p.shape, generator=gen, device=dev) * 0.01)
            else:
                p.normal_(0.0, std, generator=gen)
