"""DeepSeek-V4 checkpoints: names (transformers' and the upstream checkpoint's, `native_to_hf` / `hf_to_native`),
which tensors DeepSeek publishes in which format (`published_dtype`, `published_formats`), loading with expert and
tensor parallelism (`load_weights`), and random weights of a working shape (`init_random`)."""

from __future__ import annotations

import re
from typing import Iterable

import torch
from torch import nn

from openinfer.distributed.expert_parallel import checkpoint_slots
from openinfer.models.deepseek_v4.model import DeepseekV4ForCausalLM, Experts
from openinfer.quantization.checkpoint import QuantScheme
from openinfer.quantization.formats import FP8_MAX, float_to_e8m0, pow2_ceil


def load_weights(model: DeepseekV4ForCausalLM, weights: Iterable[tuple[str, torch.Tensor]],
                 dry_run: bool = False) -> None:
    """Tensors named as transformers' modules or as the upstream checkpoint (what `save_pretrained`
    writes: `attn.wq_a`, `ffn.experts.{e}.w1`, `hc_attn_fn`, ...; renamed by transformers' own rules,
    see `native_to_hf`); `mtp.{k}.*` for the MTP heads; quantized weights as stored with their scales
    named `<weight>_scale` (the loader's canonical name for `.scale` / `.weight_scale_inv`). Every
    parameter and routing buffer must be covered exactly once. A checkpoint without MTP tensors
    (transformers drops them) drops the heads. `dry_run`: check names and shapes only (meta tensors
    are fine), before anything is allocated."""
    params = dict(model.named_parameters())
    params.update({n: b for n, b in model.named_buffers() if n.endswith(("tid2eid", "e_score_correction_bias"))})
    n_experts = model.config.n_routed_experts
    local_slots = None
    if model.expert_placement is not None:    # expert e -> the slots of this rank that hold it
        local_slots = checkpoint_slots(model.expert_placement, model.parallel.ep_rank)
        local_logical = model.expert_placement.local_logical(model.parallel.ep_rank)[0]
    loaded = set()
    weights = (part for name, tensor in weights for part in unstacked(name, tensor, model))   # (a state_dict of ours)
    for name, tensor in weights:
        name, part = native_to_hf(name)
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        stacked = stacked_part(name, params)
        if stacked is not None:
            name = stacked[0]
        if name not in params:
            raise ValueError(f"checkpoint tensor {name!r} has no place in DeepseekV4ForCausalLM")
        dst = params[name].data
        key = name
        dsts = [dst]
        if stacked is not None:         # one matrix (or its scale) of a parameter stacking several along its rows
            i = stacked[1]
            rows = _part_rows(model, name)
            dsts = [dst[sum(rows[:i]):sum(rows[:i + 1])]]
            key = f"{name}#{i}"
        if (part is None and local_slots is not None and ".experts." in name and tensor.dim() == 3
                and tensor.shape[0] == n_experts):   # stacked experts (transformers' layout): this rank's
            tensor = tensor[local_logical]
        if part is not None:            # one expert's w1 / w3 / w2 (or its scale) of a stacked parameter
            e, w = part
            if e >= n_experts:
                raise ValueError(f"checkpoint expert {e} of {name!r} is beyond n_routed_experts={n_experts}")
            half = dst.shape[1] // 2
            slots = [e] if local_slots is None else local_slots.get(e, [])   # EP: this rank's copies
            dsts = [dst[i] if w == "w2" else dst[i, :half] if w == "w1" else dst[i, half:] for i in slots]
            key = f"{name}#{e}.{w}"
        if model.parallel.tp_size > 1:    # tensor parallelism: this rank's slice (weights and their scales)
            tensor = _tp_shard(model, name, part, tensor, dsts[0] if dsts else None, key)
        stored_raw = tensor.dtype in (torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.int8, torch.uint8)
        for dst in dsts:
            if stored_raw and dst.dtype.is_floating_point and dst.dtype.itemsize > 1:
                raise ValueError(f"checkpoint tensor {key!r} is stored {tensor.dtype} but its place holds "
                                 f"{dst.dtype}: quantized weights are never read as plain floats")
            if dst.dtype.itemsize == 1 and not stored_raw:
                raise ValueError(f"checkpoint tensor {key!r} is stored {tensor.dtype} but the other tensors "
                                 f"of its module are quantized ({dst.dtype}): one module, one format")
            if tuple(dst.shape) != tuple(tensor.shape):
                raise ValueError(f"checkpoint tensor {key!r} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(dst.shape)}")
            if not dry_run:
                dst.copy_(tensor.view(dst.dtype) if stored_raw and tensor.dtype.itemsize == 1 == dst.dtype.itemsize
                          else tensor.to(dst.dtype))
        loaded.add(key)
    if len(model.mtp) and not any(n.startswith("mtp.") for n in loaded):
        model.mtp = nn.ModuleList()
    expected = set()
    for n in (*dict(model.named_parameters()), *[b for b in dict(model.named_buffers())
                                                 if b.endswith(("tid2eid", "e_score_correction_bias"))]):
        if stacked_parts(n):
            expected |= {f"{n}#{i}" for i in range(len(stacked_parts(n)))}
        elif n.endswith(("experts.gate_up_proj", "experts.gate_up_proj_scale")) and n not in loaded:
            expected |= {f"{n}#{e}.{w}" for e in range(n_experts) for w in ("w1", "w3")}
        elif n.endswith(("experts.down_proj", "experts.down_proj_scale")) and n not in loaded:
            expected |= {f"{n}#{e}.w2" for e in range(n_experts)}
        else:
            expected.add(n)
    if model.config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
        expected.discard("lm_head.weight")
    missing = sorted(expected - loaded)
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensor(s), e.g. {missing[:5]}")

def _tp_shard(model: DeepseekV4ForCausalLM, name: str, part, tensor: torch.Tensor, dst: torch.Tensor | None,
              key: str) -> torch.Tensor:
    """This TP rank's slice of full checkpoint tensor `tensor` (our name `name`, one expert's `part`),
    for a parameter slice shaped `dst`. A quantized weight and its scale are cut along the same
    dimension at the same fraction: FP8 scales hold one value per block x block tile, MXFP4 scales one
    per 32 values along K and its bytes two values each, so slice i of the weight is slice i of its
    bytes and of its scales when the cut falls on a block (checked at start-up, check_tensor_parallel;
    a full size that is not tp x the local one is refused here)."""
    if dst is None:
        return tensor
    if part is not None:
        dim = 1 if part[1] == "w2" else 0
    else:
        dim = _tp_shard_dim(name)
        if dim is None:
            return tensor
        if name.endswith(("experts.gate_up_proj", "experts.gate_up_proj_scale")):   # stacked [E, 2I, H]
            gate, up = tensor.chunk(2, dim=1)
            half = dst.shape[1] // 2
            return torch.cat((_tp_narrow(model, gate, 1, half, key), _tp_narrow(model, up, 1, half, key)), dim=1)
    return _tp_narrow(model, tensor, dim, dst.shape[dim], key)

def _tp_narrow(model: DeepseekV4ForCausalLM, tensor: torch.Tensor, dim: int, local: int, key: str) -> torch.Tensor:
    tp, rank = model.parallel.tp_size, model.parallel.tp_rank
    if tensor.dim() <= dim or tensor.shape[dim] != local * tp:
        raise ValueError(f"checkpoint tensor {key!r} has shape {tuple(tensor.shape)}: dimension {dim} should be "
                         f"tensor_parallel_size ({tp}) x {local} (this rank's slice)")
    return tensor.narrow(dim, rank * local, local)


# tensor parallelism: which dimension of a (non-expert-slice) parameter is split over the TP ranks
_TP_SPLIT = [(re.compile(a), d) for a, d in (
    (r"^embed_tokens\.weight$", 0), (r"^lm_head\.weight$", 0),
    (r"\.self_attn\.q_b_proj\.weight(_scale)?$", 0), (r"\.self_attn\.sinks$", 0),
    (r"\.self_attn\.o_a_proj\.weight(_scale)?$", 0), (r"\.self_attn\.o_b_proj\.weight(_scale)?$", 1),
    (r"\.shared_experts\.gate_up_proj\.weight(_scale)?$", 0), (r"\.shared_experts\.down_proj\.weight(_scale)?$", 1),
    (r"\.experts\.gate_up_proj(_scale)?$", 1), (r"\.experts\.down_proj(_scale)?$", 2))]


def _tp_shard_dim(name: str) -> int | None:
    for pattern, dim in _TP_SPLIT:
        if pattern.search(name):
            return dim
    return None


# transformers' renaming of the upstream checkpoint (conversion_mapping.py, "deepseek_v4"), in its order
_NATIVE_RENAMES = [(re.compile(a), b) for a, b in (
    (r"\.attn\.", ".self_attn."), (r"\.ffn\.", ".mlp."), (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"^embed\.weight", "embed_tokens.weight"), (r"^head\.weight", "lm_head.weight"),
    (r"^hc_head_fn", "hc_head.hc_fn"), (r"^hc_head_base", "hc_head.hc_base"), (r"^hc_head_scale", "hc_head.hc_scale"),
    (r"\.attn_norm\.", ".input_layernorm."), (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_attn_fn", ".attn_hc.fn"), (r"\.hc_attn_base", ".attn_hc.base"), (r"\.hc_attn_scale", ".attn_hc.scale"),
    (r"\.hc_ffn_fn", ".ffn_hc.fn"), (r"\.hc_ffn_base", ".ffn_hc.base"), (r"\.hc_ffn_scale", ".ffn_hc.scale"),
    (r"\.attn_sink", ".sinks"), (r"\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
    (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."), (r"\.norm\.", ".kv_norm."), (r"\.ape", ".position_bias"),
    (r"\.wq_a\.", ".q_a_proj."), (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."), (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."), (r"\.wo_a\.", ".o_a_proj."), (r"\.wo_b\.", ".o_b_proj."),
    (r"\.q_norm\.", ".q_a_norm."), (r"\.gate\.bias", ".gate.e_score_correction_bias"),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."), (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
    (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."))]
_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(w1|w2|w3)\.weight(_scale)?$")
_MTP_OWN = ("enorm.", "hnorm.", "e_proj.", "h_proj.", "norm.", "hc_head")


def native_to_hf(name: str) -> tuple[str, tuple[int, str] | None]:
    """Our parameter name for a checkpoint tensor name, and (expert, w1|w2|w3) for one expert's slice."""
    name = name.removeprefix("model.")
    prefix = ""
    if name.startswith("mtp."):          # mtp.{k}.<a decoder block's names, or the head's own>
        k, rest = name.split(".", 2)[1:]
        if not rest.startswith(("layer.", *_MTP_OWN)):
            rest = "layer." + rest
        prefix, name = f"mtp.{k}.", rest
        if name.startswith("layer."):
            prefix, name = prefix + "layer", name[len("layer"):]
    for pattern, repl in _NATIVE_RENAMES:
        name = pattern.sub(repl, name)
    name = prefix + name
    m = _EXPERT.match(name)
    if m:
        stacked = m.group(1) + (".down_proj" if m.group(3) == "w2" else ".gate_up_proj") + (m.group(4) or "")
        return stacked, (int(m.group(2)), m.group(3))
    return name, None


# our parameters that stack checkpoint matrices along their rows (one GEMM where the checkpoint has two): the owning
# module's name pattern, the stacked linear's name and its parts' (transformers' names, which `native_to_hf` gives).
# The attention's q_a_kv_proj exists only where `join_projections` joined its parts at load (else they load as
# themselves).
_STACKED = [(r".*\.shared_experts", "gate_up_proj", ("gate_proj", "up_proj")),
            (r".*\.compressor(?:\.indexer)?", "kv_gate_proj", ("kv_proj", "gate_proj")),
            (r".*\.self_attn", "q_a_kv_proj", ("q_a_proj", "kv_proj"))]
_STACKED_RE = [(re.compile(rf"^({stem})\.{stacked}\.(weight(?:_scale)?)$"),
                re.compile(rf"^({stem})\.({'|'.join(parts)})\.(weight(?:_scale)?)$"), stacked, parts)
               for stem, stacked, parts in _STACKED]


def stacked_parts(name: str) -> list[str]:
    """The checkpoint matrices (transformers' names) that our parameter `name` stacks along its rows, in row order;
    [] when it stacks none (`SharedExpert.gate_up_proj.weight`: the gate_proj and up_proj weights;
    `Compressor.kv_gate_proj.weight`: kv_proj and gate_proj; a joined `q_a_kv_proj.weight`: q_a_proj and kv_proj)."""
    for whole, _, _, parts in _STACKED_RE:
        m = whole.match(name)
        if m:
            return [f"{m.group(1)}.{p}.{m.group(2)}" for p in parts]
    return []


def stacked_part(name: str, params=None) -> tuple[str, int, int] | None:
    """A checkpoint matrix (transformers' name) that one of our parameters stacks -> (that parameter, the matrix's
    index among its parts, the number of parts); None for any other name, and (with `params`, a model's parameter
    names) where the model has no such parameter (q_a_proj and kv_proj not joined)."""
    for _, part, stacked, parts in _STACKED_RE:
        m = part.match(name)
        if m:
            whole = f"{m.group(1)}.{stacked}.{m.group(3)}"
            if params is not None and whole not in params:
                return None
            return whole, parts.index(m.group(2)), len(parts)
    return None


def _part_rows(model: torch.nn.Module, name: str) -> tuple[int, ...]:
    """The rows of each part of our stacked parameter `name` (its module's `part_rows`: StackedLinear, Fp8Linear)."""
    module_name, _, param = name.rpartition(".")
    return model.get_submodule(module_name).part_rows(param)


def unstacked(name: str, tensor: torch.Tensor, model: torch.nn.Module | None = None) -> list[tuple[str, torch.Tensor]]:
    """One of our tensors as the checkpoint matrices it holds (transformers' names): a stacked one split along its
    rows in the proportions of `model`'s parts (the tensor may be a whole one, `model` a tensor-parallel shard;
    without a model in equal parts, as constructed), any other as itself."""
    parts = stacked_parts(name)
    if not parts:
        return [(name, tensor)]
    rows = _part_rows(model, name) if model is not None else (1,) * len(parts)
    n = tensor.shape[0]
    if any(n * r % sum(rows) for r in rows):
        raise ValueError(f"{name!r}: {n} rows do not split into parts of {rows} rows' proportions")
    return list(zip(parts, tensor.split([n * r // sum(rows) for r in rows])))


# the inverse: our parameter name -> the upstream checkpoint's (for writing checkpoints in the published layout)
_HF_TO_NATIVE = [(re.compile(a), b) for a, b in (
    (r"^embed_tokens\.weight$", "embed.weight"), (r"^lm_head\.weight$", "head.weight"),
    (r"(^|\.)hc_head\.hc_(fn|base|scale)$", r"\1hc_head_\2"),
    (r"\.input_layernorm\.", ".attn_norm."), (r"\.post_attention_layernorm\.", ".ffn_norm."),
    (r"\.(attn|ffn)_hc\.(fn|base|scale)$", r".hc_\1_\2"),
    (r"\.compressor\.indexer\.scorer\.weights_proj\.", ".indexer.weights_proj."),
    (r"\.compressor\.indexer\.q_b_proj\.", ".indexer.wq_b."), (r"\.compressor\.indexer\.", ".indexer.compressor."),
    (r"\.compressor\.kv_norm\.", ".compressor.norm."), (r"\.compressor\.kv_proj\.", ".compressor.wkv."),
    (r"\.compressor\.gate_proj\.", ".compressor.wgate."), (r"\.compressor\.position_bias$", ".compressor.ape"),
    (r"\.self_attn\.", ".attn."), (r"\.attn\.q_a_proj\.", ".attn.wq_a."), (r"\.attn\.q_b_proj\.", ".attn.wq_b."),
    (r"\.attn\.kv_proj\.", ".attn.wkv."), (r"\.attn\.o_a_proj\.", ".attn.wo_a."), (r"\.attn\.o_b_proj\.", ".attn.wo_b."),
    (r"\.attn\.q_a_norm\.", ".attn.q_norm."), (r"\.attn\.sinks$", ".attn.attn_sink"), (r"\.mlp\.", ".ffn."),
    (r"\.gate\.e_score_correction_bias$", ".gate.bias"), (r"\.shared_experts\.gate_proj\.", ".shared_experts.w1."),
    (r"\.shared_experts\.down_proj\.", ".shared_experts.w2."), (r"\.shared_experts\.up_proj\.", ".shared_experts.w3."),
    (r"^mtp\.(\d+)\.layer\.", r"mtp.\1."))]

# which upstream tensors DeepSeek publishes in FP8 (block-scaled); routed experts follow `expert_dtype`;
# float32 ones; everything else (embeddings, head, norms, router, compressors, indexer weights_proj) is bf16
_PUBLISHED_FP8 = re.compile(r"(\.attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|\.attn\.indexer\.wq_b|\.shared_experts\.w[123]"
                            r"|^mtp\.\d+\.(e_proj|h_proj))\.weight$")
_PUBLISHED_FP32 = re.compile(r"(hc_(attn|ffn|head)_(fn|base|scale)|\.attn_sink|\.ape|\.gate\.bias)$")


def hf_to_native(name: str) -> str:
    """The upstream checkpoint's name of one of our (non-expert) tensors; `native_to_hf` inverts it."""
    for pattern, repl in _HF_TO_NATIVE:
        name = pattern.sub(repl, name)
    return name


def published_dtype(native_name: str, expert_fmt: str | None) -> str:
    """"fp8" | "mxfp4" | "fp32" | "bf16" | "int": how DeepSeek publishes an upstream tensor; `expert_fmt`
    None means a bf16 checkpoint (nothing quantized)."""
    if native_name.endswith("tid2eid"):
        return "int"
    if _PUBLISHED_FP32.search(native_name):
        return "fp32"
    if expert_fmt is not None:
        if native_to_hf(native_name)[1] is not None:      # one routed expert's w1 / w2 / w3
            return expert_fmt
        if _PUBLISHED_FP8.search(native_name):
            return "fp8"
    return "bf16"


def published_formats(model: DeepseekV4ForCausalLM, scheme: QuantScheme | None) -> dict[str, str]:
    """Module -> "fp8" | "mxfp4" for the weights DeepSeek publishes quantized under `scheme` (None: none)."""
    if scheme is None:
        return {}
    formats = {}
    for name, module in model.named_modules():
        if isinstance(module, Experts):
            formats[name] = scheme.expert_fmt
        elif (isinstance(module, torch.nn.Linear)      # (a stacked linear: as its parts, published alike)
              and published_dtype(hf_to_native((stacked_parts(name + ".weight") or [name + ".weight"])[0]),
                                  "fp8") == "fp8"):
            formats[name] = "fp8"
    return formats


def init_random(model: DeepseekV4ForCausalLM, seed: int, std: float = 0.02) -> None:
    """Random weights of a working shape: normal(std) matrices, unit norms and mHC scales, small random
    biases/sinks, a random hash table (tid2eid), so every branch carries signal. Quantized weights get
    random stored values (FP8 values, E2M1 nibbles) with one power-of-two scale giving about the same std."""
    dev = next(model.parameters()).device
    gen = torch.Generator(device=dev).manual_seed(seed)   # drawn where the weights live (GB-sized on GPUs)
    n_experts = model.config.n_routed_experts
    fp8_std, e2m1_std = 16.0, 2.93     # of randn*16 cast to E4M3, and of uniformly random E2M1 codes
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("_scale") and p.dtype == torch.float8_e8m0fnu:
                fmt = getattr(model.get_submodule(name.rsplit(".", 1)[0]), "fmt", "fp8")
                byte = float_to_e8m0(pow2_ceil(torch.tensor(std / (e2m1_std if fmt == "mxfp4" else fp8_std))))
                p.view(torch.uint8).fill_(int(byte.view(torch.uint8)))
            elif p.dtype == torch.uint8:          # packed E2M1
                p.copy_(torch.randint(0, 256, p.shape, generator=gen, device=dev, dtype=torch.uint8))
            elif p.dtype == torch.float8_e4m3fn:  # in slices: no full-size float temporary
                for i in range(0, p.shape[0], max(1, (64 << 20) // p[0].numel())):
                    part = p[i:i + max(1, (64 << 20) // p[0].numel())]
                    part.copy_((torch.randn(part.shape, generator=gen, device=dev, dtype=torch.bfloat16) * fp8_std)
                               .clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn))
            elif name.endswith("norm.weight") or name.endswith(("_hc.scale", "hc_head.hc_scale")):
                p.fill_(1.0)
            elif name.endswith(("sinks", "position_bias", "_hc.base", "hc_head.hc_base")):
                p.copy_(torch.randn(p.shape, generator=gen, device=dev) * 0.5)
            else:
                p.normal_(0.0, std, generator=gen)
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):   # top_k distinct experts per token
                b.copy_(torch.rand(b.shape[0], n_experts, generator=gen, device=dev).argsort(-1)[:, :b.shape[1]])
            elif name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=gen, device=dev) * 0.01)
