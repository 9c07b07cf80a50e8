"""`python -m openinfer.tools.train_draft_head`: fit a DSpark-shaped draft head (`draft_head.py`) to an HF model by
self-distillation (issue 12 item 6; docs/spec_decode.md, "Training a draft head").

Why self-distillation: the head is judged by one thing, whether the *target's* greedy verification keeps its
drafts, so its labels are the target's own argmax tokens at every position, computed in the same forward that gives
the context features, never a dataset's text. The target writes its own continuations of real prompts (greedy), so
context and labels come from the distribution the head will see when drafting.

Steps: greedy generations of the training prompts -> one target forward per batch over prompt + generation
(`hf_target_features`: layer-input features and the target's next token everywhere) -> random anchors P in the
generated part, block P + 1 .. P + n with t = the target's token for P + 1 -> loss:

- cross-entropy of block position i's logits (Markov bias included, teacher forcing: prev_i is the target's token
  before it) against the target's token at P + 2 + i;
- binary cross-entropy of the confidence logit against "draft i would be accepted", on the positions a greedy
  verify actually reaches: every earlier draft accepted (the first rejection included). The confidence is then the
  *conditional* acceptance probability the verification policy multiplies up, and this loss is exactly the
  log-likelihood of each block's accepted length under that cumprod model. Acceptance is read from the head's own
  argmax in the same pass (detached); with teacher forcing and all earlier drafts accepted, prev_i equals what
  greedy drafting would feed, so this is the greedy outcome.

Prompts: training uses real text the benchmark does not (Python's own reference documentation,
`pydoc_data.topics`, split into passages) under the benchmark's task framings (`benchmarks/spec.py`: typo fixing
with its `add_typos`, its summary instructions, open questions); the held-out evaluation uses the benchmark's own
prompts (`task_prompts`), so a head trained here is not fitted to what `openinfer bench spec` measures; the last 5%
of the training-style prompts are kept out of training as an in-domain validation set. Evaluation:
greedy drafting from each held-out anchor, accepted = the prefix of drafts equal to the target's greedy
continuation; reports accepted drafts per block, acceptance per position and the confidence calibration.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from openinfer.benchmarks.spec import SUMMARY_INSTRUCTIONS, TASKS, add_typos, task_prompts
from openinfer.spec_decode.draft_head import DraftHead, DraftHeadConfig, hf_target_features


@dataclass
class TrainConfig:
    model: str                              # HF-format directory or a registered openinfer model name
    out: str | None = None                  # where the head and metrics.json go (None: not saved)
    # defaults: the H200 run of docs/spec_decode.md (about 150 s for SmolLM2-135M); pass far smaller on a CPU
    steps: int = 1100                       # under one epoch of the default data: more epochs memorise
    prompts: int = 5000                     # training prompts
    eval_prompts: int = 8                   # held-out prompts per benchmark task
    max_new_tokens: int = 160
    max_prompt_chars: int = 1500
    batch_size: int = 512                   # sequences per generation / feature forward
    anchors: int = 512                      # blocks per training step
    lr: float = 1e-3
    weight_decay: float = 0.01
    warmup: int = 50
    block_size: int = 4
    window: int = 64
    target_layers: tuple[int, ...] | None = None
    num_layers: int = 1
    markov_rank: int = 64
    device: str | None = None               # None: cuda if available, else cpu
    dtype: str = "auto"                     # target dtype: auto = bfloat16 on CUDA, float32 on CPU
    seed: int = 0
    log_every: int = 50
    eval_max_blocks: int = 4096


# ---------------------------------------------------------------------------------------------------------------
# prompts

def _doc_passages(min_chars: int = 300, max_chars: int = 1200) -> list[tuple[str, str]]:
    """(topic, passage) from Python's reference documentation: paragraphs merged up to max_chars."""
    from pydoc_data.topics import topics

    out = []
    for name in sorted(topics):
        buf = ""
        for para in topics[name].split("\n\n"):
            para = para.strip()
            if not para or set(para) <= set("*=-"):
                continue
            if buf and len(buf) + len(para) > max_chars:
                if len(buf) >= min_chars:
                    out.append((name, buf))
                buf = ""
            buf = f"{buf}\n\n{para}" if buf else para
        if len(buf) >= min_chars:
            out.append((name, buf[:max_chars]))
    return out


STDLIB_MODULES = ("argparse", "asyncio", "base64", "bisect", "calendar", "collections", "configparser", "contextlib",
                  "copy", "csv", "dataclasses", "datetime", "decimal", "difflib", "enum", "fnmatch", "fractions",
                  "functools", "glob", "gzip", "hashlib", "heapq", "html", "http.client", "inspect", "ipaddress",
                  "itertools", "json", "logging", "math", "operator", "os", "pathlib", "pickle", "pprint", "queue",
                  "random", "re", "sched", "secrets", "shlex", "shutil", "socket", "sqlite3", "statistics", "string",
                  "struct", "subprocess", "tarfile", "tempfile", "textwrap", "threading", "timeit", "tokenize",
                  "traceback", "typing", "unittest", "urllib.parse", "uuid", "warnings", "weakref", "zipfile")


@functools.lru_cache(maxsize=None)
def _stdlib_items(max_chars: int = 1200) -> list[tuple[str, str, str]]:
    """(qualified name, docstring, source) of the public functions and classes of some stdlib modules: real English
    documentation and real Python code, shipped with every Python."""
    import importlib
    import inspect

    out = []
    for mod_name in STDLIB_MODULES:
        try:
            mod = importlib.import_module(mod_name)
        except ImportError:
            continue
        for name, obj in sorted(vars(mod).items()):
            if name.startswith("_") or getattr(obj, "__module__", None) != mod.__name__:
                continue
            if not (inspect.isfunction(obj) or inspect.isclass(obj)):
                continue
            doc = inspect.getdoc(obj) or ""
            try:
                src = inspect.getsource(obj)
            except (OSError, TypeError):
                src = ""
            if len(doc) >= 120 or 200 <= len(src) <= max_chars:
                out.append((f"{mod_name}.{name}", doc[:max_chars], src if len(src) <= max_chars else ""))
    return out


def training_messages(n: int, seed: int = 0) -> list[str]:
    """n user messages over real text the benchmark does not use -- Python's reference documentation
    (`pydoc_data.topics`) and the docstrings and source of stdlib functions and classes -- in the benchmark's
    kinds of task: fix the typos (`add_typos`), summarise (`SUMMARY_INSTRUCTIONS`), repeat code with a function
    renamed, answer an open question."""
    rng = random.Random(seed)
    passages = _doc_passages() + [(name, doc) for name, doc, _ in _stdlib_items() if len(doc) >= 300]
    code = [(name, src) for name, _, src in _stdlib_items() if src.startswith("def ")]
    names = sorted({name for name, _ in passages})
    rng.shuffle(passages)
    rng.shuffle(code)
    out: dict[str, None] = {}      # distinct messages in order (a repeated prompt repeats its generation)
    add = out.setdefault
    i = -1
    while len(out) < n and i < 20 * n:
        i += 1
        topic, text = passages[i % len(passages)]
        kind = i % 5
        if kind == 0:
            add("Rewrite the following text, fixing the typos. Keep everything else the same.\n\n"
                       + add_typos(text, seed=seed + i))
        elif kind == 1:
            add(f"{SUMMARY_INSTRUCTIONS[(i // 5) % len(SUMMARY_INSTRUCTIONS)]}\n\n{text}")
        elif kind == 2 and code:
            name, src = code[(i // 5) % len(code)]
            old = src[4:src.index("(")]
            add(f"Repeat the following Python code with the function `{old}` renamed to `{old}_v2`. "
                       f"Change nothing else.\n\n```python\n{src}```")
        elif kind == 3:
            add(f"What is `{names[(i * 7) % len(names)].replace('-', ' ')}` in Python? Answer briefly.")
        else:
            add(f"Explain the Python topic '{topic.replace('-', ' ')}' simply, with a short example.")
    return list(out)


def heldout_messages(per_task: int) -> list[str]:
    """The benchmark's own prompts (`openinfer bench spec`), the first `per_task` of each task."""
    return [p for task in TASKS for p in task_prompts(task, per_task)]


# ---------------------------------------------------------------------------------------------------------------
# data: generations, features, labels

def load_target(model: str, device: str, dtype: torch.dtype):
    """An HF `AutoModelForCausalLM` and tokenizer from an HF-format directory (a registered openinfer name, e.g.
    smollm2-135m-instruct, resolves to the directory openinfer converts its GGUF into)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from openinfer.config import default_cache_dir
    from openinfer.loader.model_source import resolve_model_dir

    path = Path(model) if Path(model).is_dir() else resolve_model_dir(model, default_cache_dir())
    target = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(device).eval()
    return target, AutoTokenizer.from_pretrained(str(path))


def chat_ids(tokenizer, message: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True,
                                        tokenize=True, return_dict=False)
    return list(ids)


@torch.no_grad()
def generate(target, tokenizer, messages: list[str], max_new_tokens: int, batch_size: int,
             max_prompt_chars: int = 1500) -> list[tuple[list[int], int]]:
    """(prompt + greedy continuation up to and including EOS, prompt length) per message, batched left-padded."""
    device = next(target.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos = tokenizer.eos_token_id
    prompts = [chat_ids(tokenizer, m[:max_prompt_chars]) for m in messages]
    out = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start:start + batch_size]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=device)
        gen = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                              eos_token_id=eos, pad_token_id=pad, temperature=None, top_p=None, top_k=None)
        for p, row in zip(chunk, gen[:, width:].tolist()):
            cont = row[:row.index(eos) + 1] if eos in row else row
            out.append((p + cont, len(p)))
    return out


@dataclass
class Corpus:
    """Right-padded sequences with their target features and labels, and the anchors blocks may start from."""
    features: torch.Tensor      # [N, T, n_target * hidden]
    tokens: torch.Tensor        # [N, T]
    target_next: torch.Tensor   # [N, T]: the target's greedy token for position p + 1, given tokens[: p + 1]
    anchors: torch.Tensor       # [M, 2] (sequence, P): a full block after P is in the generated, target-own part

    @classmethod
    @torch.no_grad()
    def build(cls, target, sequences: list[tuple[list[int], int]], layer_ids, block_size: int, batch_size: int,
              pad_id: int) -> "Corpus":
        device = next(target.parameters()).device
        T = max(len(s) for s, _ in sequences)
        N = len(sequences)
        tokens = torch.full((N, T), pad_id, dtype=torch.long, device=device)
        for i, (s, _) in enumerate(sequences):
            tokens[i, :len(s)] = torch.tensor(s, device=device)
        lengths = torch.tensor([len(s) for s, _ in sequences], device=device)
        prompt_lens = torch.tensor([p for _, p in sequences], device=device)
        mask = (torch.arange(T, device=device)[None, :] < lengths[:, None]).long()
        feats, nexts = [], []
        for start in range(0, N, batch_size):
            f, nt = hf_target_features(target, tokens[start:start + batch_size], mask[start:start + batch_size],
                                       layer_ids)
            feats.append(f)
            nexts.append(nt)
        features, target_next = torch.cat(feats), torch.cat(nexts)
        # a block after P uses tokens P + 1 .. P + n as t, prev_1 .. prev_{n-1}: they must be the target's own
        # greedy tokens in this very forward (generation ran with a KV cache and, on CUDA, in bf16: rare flips)
        own = torch.zeros_like(tokens, dtype=torch.bool)
        own[:, :-1] = tokens[:, 1:] == target_next[:, :-1]
        pos = torch.arange(T, device=device)[None, :]
        ok = (pos >= prompt_lens[:, None] - 1) & (pos + block_size <= lengths[:, None] - 1)
        for j in range(block_size):
            ok &= torch.roll(own, -j, dims=1) & (pos + j < T)
        return cls(features, tokens, target_next, ok.nonzero())


def block_batch(corpus: Corpus, anchors: torch.Tensor, window: int, block_size: int) -> dict[str, torch.Tensor]:
    """The training/eval inputs of blocks after these anchors: the newest `window` context rows through P."""
    b, P = anchors[:, 0], anchors[:, 1]
    dev = P.device
    positions = P[:, None] - window + 1 + torch.arange(window, device=dev)
    valid = positions >= 0
    positions = positions.clamp_min(0)
    steps = torch.arange(block_size, device=dev)
    return dict(features=corpus.features[b[:, None], positions], positions=positions, valid=valid,
                last_positions=P, next_tokens=corpus.target_next[b, P],
                prev_tokens=corpus.target_next[b[:, None], P[:, None] + steps],      # the token before draft i
                labels=corpus.target_next[b[:, None], P[:, None] + 1 + steps])       # the token at P + 2 + i


# ---------------------------------------------------------------------------------------------------------------
# loss, training, evaluation

def block_loss(head: DraftHead, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Cross-entropy over every draft + BCE of the confidence on the positions a greedy verify reaches."""
    logits, conf = head(batch["features"], batch["positions"], batch["valid"], batch["last_positions"],
                        batch["next_tokens"], batch["prev_tokens"])
    labels = batch["labels"]
    ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
    correct = (logits.argmax(-1) == labels).detach()
    reached = torch.cumprod(torch.cat([torch.ones_like(correct[:, :1]), correct[:, :-1]], 1).float(), 1)
    bce = (F.binary_cross_entropy_with_logits(conf, correct.float(), reduction="none") * reached).sum() \
        / reached.sum().clamp_min(1)
    return ce + bce, dict(ce=ce.detach(), bce=bce.detach(), accuracy=correct.float().mean(0))


def _autocast(device: torch.device):
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


def fit(head: DraftHead, corpus: Corpus, steps: int, anchors: int, lr: float, warmup: int, seed: int,
        log_every: int, log=print, weight_decay: float = 0.0, heldout: Corpus | None = None) -> list[dict]:
    """AdamW with linear warm-up then cosine decay to 10%; returns the logged intervals' means (with the held-out
    accepted drafts per block at each log line when `heldout` is given: only watched, never used to choose)."""
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95))
    warmup = min(warmup, max(steps // 10, 1))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup) * (
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s, steps) / max(steps, 1)))))
    gen = torch.Generator(device="cpu").manual_seed(seed)
    device = head.main_proj.weight.device
    history, acc_sum, n_sum, ce_sum, bce_sum, t0 = [], 0.0, 0, 0.0, 0.0, time.perf_counter()
    head.train()
    for step in range(1, steps + 1):
        pick = torch.randint(0, corpus.anchors.shape[0], (anchors,), generator=gen).to(corpus.anchors.device)
        batch = block_batch(corpus, corpus.anchors[pick], head.cfg.window, head.cfg.block_size)
        with _autocast(device):
            loss, parts = block_loss(head, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        ce_sum, bce_sum, n_sum = ce_sum + parts["ce"], bce_sum + parts["bce"], n_sum + 1
        acc_sum = acc_sum + parts["accuracy"]
        if step % log_every == 0 or step == steps:
            row = dict(step=step, ce=float(ce_sum / n_sum), bce=float(bce_sum / n_sum),
                       accuracy=[round(a, 4) for a in (acc_sum / n_sum).tolist()],
                       lr=sched.get_last_lr()[0], seconds=round(time.perf_counter() - t0, 1))
            if heldout is not None:
                row["heldout_accepted_drafts_per_block"] = evaluate(head, heldout, 1024)["accepted_drafts_per_block"]
                head.train()
            history.append(row)
            log(f"step {step:5d}  ce {row['ce']:.3f}  bce {row['bce']:.3f}  acc/pos {row['accuracy']}  "
                f"lr {row['lr']:.2e}  {row['seconds']}s"
                + (f"  held-out accepted/block {row['heldout_accepted_drafts_per_block']:.3f}" if heldout else ""))
            acc_sum, n_sum, ce_sum, bce_sum = 0.0, 0, 0.0, 0.0
    head.eval()
    return history


@torch.no_grad()
def evaluate(head: DraftHead, corpus: Corpus, max_blocks: int = 4096, batch: int = 256) -> dict:
    """Greedy drafting from (up to max_blocks evenly spaced) anchors. accepted = the prefix of drafts equal to the
    target's greedy continuation. Calibration per position i, over the blocks whose drafts < i were accepted: the
    mean confidence (the head's estimate of P(accept i | accepted < i)) vs the actual rate; and over all blocks the
    expected accepted drafts sum_i cumprod(c)_i vs the actual mean."""
    anchors = corpus.anchors
    if anchors.shape[0] > max_blocks:
        anchors = anchors[torch.linspace(0, anchors.shape[0] - 1, max_blocks).long()]
    n = head.cfg.block_size
    accepted_all, conf_all = [], []
    for start in range(0, anchors.shape[0], batch):
        inputs = block_batch(corpus, anchors[start:start + batch], head.cfg.window, n)
        with _autocast(inputs["features"].device):
            draft = head.draft(inputs["features"], inputs["positions"], inputs["valid"], inputs["last_positions"],
                               inputs["next_tokens"])
        accepted_all.append(torch.cumprod((draft.tokens == inputs["labels"]).long(), 1))
        conf_all.append(draft.confidences.float())
    if not accepted_all:
        raise ValueError("no held-out blocks: the generations are shorter than one block")
    accepted, conf = torch.cat(accepted_all).float(), torch.cat(conf_all)
    reached = torch.cat([torch.ones_like(accepted[:, :1]), accepted[:, :-1]], 1)
    per_reached = reached.sum(0).clamp_min(1)
    mean_accepted = accepted.sum(1).mean().item()
    return dict(
        blocks=accepted.shape[0],
        accepted_drafts_per_block=mean_accepted,
        mean_accepted_length=1.0 + mean_accepted,           # the spec's figure: + the target's own token
        accept_rate_by_position=accepted.mean(0).tolist(),  # P(draft i accepted), prefix rule
        conditional_accept_by_position=((accepted * reached).sum(0) / per_reached).tolist(),
        mean_confidence_by_position=((conf * reached).sum(0) / per_reached).tolist(),
        predicted_accepted_drafts_per_block=torch.cumprod(conf, 1).sum(1).mean().item(),
    )


# ---------------------------------------------------------------------------------------------------------------

def run(cfg: TrainConfig, log=print, target=None) -> tuple[DraftHead, dict]:
    """Generate, featurise, evaluate the untrained head, train, evaluate again; save if cfg.out. Returns the
    trained head and the metrics. `target`: an already loaded (model, tokenizer) to reuse."""
    torch.manual_seed(cfg.seed)
    device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = (torch.bfloat16 if device.type == "cuda" else torch.float32) if cfg.dtype == "auto" \
        else getattr(torch, cfg.dtype)
    t0 = time.perf_counter()
    model, tok = target if target is not None else load_target(cfg.model, str(device), dtype)
    device = next(model.parameters()).device
    noise = tok.unk_token_id if tok.unk_token_id is not None else tok.pad_token_id
    head_cfg = DraftHeadConfig.for_target(model.config, noise_token_id=noise, block_size=cfg.block_size,
                                          window=cfg.window, target_layer_ids=cfg.target_layers,
                                          num_layers=cfg.num_layers, markov_rank=cfg.markov_rank)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    def corpus(seqs, what, seconds):
        c = Corpus.build(model, seqs, head_cfg.target_layer_ids, cfg.block_size, cfg.batch_size, pad)
        log(f"{what}: {len(seqs)} prompts, {sum(len(s) - p for s, p in seqs)} generated tokens, "
            f"{c.anchors.shape[0]} blocks ({time.perf_counter() - seconds:.1f}s)")
        return c

    # the last few training-style prompts are never trained on: an in-domain check beside the benchmark's prompts
    n_val = max(2, cfg.prompts // 20)
    t = time.perf_counter()
    seqs = generate(model, tok, training_messages(cfg.prompts + n_val, cfg.seed), cfg.max_new_tokens,
                    cfg.batch_size, cfg.max_prompt_chars)
    train_corpus = corpus(seqs[:cfg.prompts], "train", t)
    val_corpus = corpus(seqs[cfg.prompts:], "validation (training-style prompts, not trained on)", t)
    t = time.perf_counter()
    eval_corpus = corpus(generate(model, tok, heldout_messages(cfg.eval_prompts), cfg.max_new_tokens,
                                  cfg.batch_size, cfg.max_prompt_chars), "held-out (benchmark prompts)", t)
    emb = model.get_input_embeddings().weight
    head = DraftHead(head_cfg, emb, model.get_output_embeddings().weight).to(device)
    untrained = evaluate(head, eval_corpus, cfg.eval_max_blocks)
    log(f"untrained head: accepted drafts/block {untrained['accepted_drafts_per_block']:.3f}")
    history = fit(head, train_corpus, cfg.steps, cfg.anchors, cfg.lr, cfg.warmup, cfg.seed, cfg.log_every, log,
                  cfg.weight_decay, eval_corpus)
    trained = evaluate(head, eval_corpus, cfg.eval_max_blocks)
    train_eval = evaluate(head, train_corpus, cfg.eval_max_blocks)
    val_eval = evaluate(head, val_corpus, cfg.eval_max_blocks)
    log(f"trained head: held-out accepted drafts/block {trained['accepted_drafts_per_block']:.3f} "
        f"(mean accepted length {trained['mean_accepted_length']:.3f}; validation "
        f"{val_eval['accepted_drafts_per_block']:.3f}; training prompts {train_eval['accepted_drafts_per_block']:.3f})")
    log("  accept rate by position      " + " ".join(f"{x:.3f}" for x in trained["accept_rate_by_position"]))
    log("  P(accept i | accepted < i)   " + " ".join(f"{x:.3f}" for x in trained["conditional_accept_by_position"]))
    log("  mean confidence (same rows)  " + " ".join(f"{x:.3f}" for x in trained["mean_confidence_by_position"]))
    log(f"  predicted accepted drafts/block {trained['predicted_accepted_drafts_per_block']:.3f}")
    metrics = dict(config={k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(cfg).items()},
                   head=json.loads(head_cfg.to_json()), device=str(device), dtype=str(dtype),
                   untrained=untrained, trained=trained, validation=val_eval, trained_on_training_prompts=train_eval,
                   history=history, seconds=round(time.perf_counter() - t0, 1))
    if cfg.out:
        head.save(cfg.out)
        (Path(cfg.out) / "metrics.json").write_text(json.dumps(metrics, indent=2))
        log(f"wrote {cfg.out}")
    return head, metrics


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m openinfer.tools.train_draft_head", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    d = TrainConfig(model="")
    p.add_argument("--model", default="smollm2-135m-instruct",
                   help="HF-format directory, or a registered openinfer model name (default: %(default)s)")
    p.add_argument("--out", required=True, help="directory for draft_head.json, draft_head.safetensors, metrics.json")
    for name in ("steps", "prompts", "eval_prompts", "max_new_tokens", "max_prompt_chars", "batch_size", "anchors",
                 "warmup", "block_size", "window", "num_layers", "markov_rank", "seed", "log_every", "eval_max_blocks"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name))
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--target-layers", type=_ints, default=None,
                   help="comma-separated target layers whose inputs are the features (default: early, middle, last)")
    p.add_argument("--device", default=None, help="cuda | cpu (default: cuda if available)")
    p.add_argument("--dtype", default=d.dtype, help="target dtype: auto | float32 | bfloat16")
    args = p.parse_args(argv)
    cfg = TrainConfig(**{k: v for k, v in vars(args).items()})
    run(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
