"""Training data for a draft head, made locally: the target's own answers plus its hidden states.

Self-distillation: each prompt is wrapped in the target's chat template and answered by the target
itself (batched, left-padded, greedy by default), and the target's post-norm last hidden state of
every token (prompt and answer) is kept, so training never runs the target again. Recorded traffic
(JSONL with `prompt` or `messages`, and `output`) is teacher-forced through the target instead.

Everything lands in shards under `DIR` (one safetensors file per batch of prompts, hidden states in
fp16), so an interrupted run resumes where it stopped and epochs cost only the head.

Shard layout: `ids` int32 [total], `hidden` fp16 [total, H], `offsets` int64 [n+1] (sample i is
`[offsets[i], offsets[i+1])`), `prompt_lens` int64 [n]. A JSONL twin holds the texts for inspection.
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

log = logging.getLogger(__name__)


@dataclass
class Sample:
    """One conversation: tokens x_0..x_{n-1}, the target's features f_0..f_{n-1}, and where the answer starts."""

    ids: torch.Tensor  # [n] int32
    hidden: torch.Tensor  # [n, H] fp16
    prompt_len: int


def read_prompts(path: str | Path) -> list[str]:
    """Prompts from a JSONL file whose lines are {"prompt": "..."} (blank lines skipped)."""
    prompts = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if line.strip():
            record = json.loads(line)
            if not isinstance(record.get("prompt"), str):
                raise ValueError(f"{path}:{n}: expected {{\"prompt\": \"...\"}}")
            prompts.append(record["prompt"])
    return prompts


@dataclass(frozen=True)
class TrafficRecord:
    """One recorded conversation turn. `prompt_ids` / `output_ids`: the exact tokens the server fed and
    generated (records from `serve --record-traffic`), else None (the text is tokenized here)."""

    messages: list[dict[str, str]]
    output: str
    prompt_ids: list[int] | None = None
    output_ids: list[int] | None = None


def read_traffic(directory: str | Path) -> list[TrafficRecord]:
    """Records from every `*.jsonl` under `directory` (and their rotated `*.jsonl.N` files).

    A record is {"prompt": str, "output": str} (a single user turn), {"messages": [{"role", "content"},
    ...], "output": str}, or what `serve --record-traffic` writes (server/traffic.py): either of those
    plus "prompt_ids" and "output_ids", which are then used as they are.
    """
    records = []
    files = sorted({*Path(directory).glob("*.jsonl"), *Path(directory).glob("*.jsonl.[0-9]*")})
    for file in files:
        for n, line in enumerate(file.read_text().splitlines(), 1):
            if not line.strip():
                continue
            record = json.loads(line)
            output = record.get("output")
            prompt_ids, output_ids = record.get("prompt_ids"), record.get("output_ids")
            if isinstance(prompt_ids, list) and isinstance(output_ids, list) and isinstance(output, str):
                messages = record.get("messages") or [{"role": "user", "content": record.get("prompt") or ""}]
                records.append(TrafficRecord(messages, output, prompt_ids, output_ids))
                continue
            messages = record.get("messages") or [{"role": "user", "content": record.get("prompt")}]
            if not isinstance(output, str) or not all(isinstance(m.get("content"), str) for m in messages):
                raise ValueError(f"{file}:{n}: expected prompt or messages, and output (strings)")
            records.append(TrafficRecord(messages, output))
    return records


def chat_ids(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]]) -> list[int]:
    """The prompt as the server feeds it: chat template with the generation prompt (plain text when the
    tokenizer has no template)."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.encode("\n".join(m["content"] for m in messages))


def _stop_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> set[int]:
    ids = {tokenizer.eos_token_id}
    eos = getattr(model.generation_config, "eos_token_id", None)
    ids.update(eos if isinstance(eos, list) else [eos])
    return {int(i) for i in ids if i is not None}


@torch.inference_mode()
def answer_batch(
    model: PreTrainedModel,
    prompts: list[list[int]],
    stop_ids: set[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    check_every: int | None = None,
) -> list[Sample]:
    """Answer `prompts` (token ids) with `model` in one left-padded batch and keep its features.

    The answer is greedy at temperature 0, sampled otherwise (`generator` on the model's device). A
    sample ends with its stop token (whose feature is kept: it is fed once more so the head also learns
    what follows) or at `max_new_tokens`. Every `check_every` steps finished rows leave the batch, so
    long answers don't drag short ones along; in between, a finished row runs on and what it makes
    after its stop is cut off. Checking costs a device sync, so on a GPU it happens every 16 steps
    (the default there) and tokens and features stay on the device until the batch is done.
    """
    device = model.device
    check_every = check_every or (1 if device.type == "cpu" else 16)
    batch = len(prompts)
    width = max(len(p) for p in prompts)
    ids = torch.zeros(batch, width, dtype=torch.long)
    mask = torch.zeros(batch, width, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, width - len(p):] = torch.tensor(p)
        mask[b, width - len(p):] = 1
    ids, mask = ids.to(device), mask.to(device)
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache()
    out = model.model(input_ids=ids, attention_mask=mask, position_ids=position_ids, cache=cache,
                      use_cache=True)
    prompt_feats = out.last_hidden_state.half().cpu()
    last = out.last_hidden_state[:, -1]  # [rows, H]
    stops = torch.tensor(sorted(stop_ids), device=device)
    rows = torch.arange(batch, device=device)  # the sample each batch row answers
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    positions = position_ids[:, -1]
    made_rows, made_tokens, made_feats = [], [], []  # per step, for the rows alive at that step
    for step in range(max_new_tokens):
        logits = model.lm_head(last).float()  # [rows, V]
        if temperature > 0:
            probs = torch.softmax(logits / temperature, dim=-1)
            nxt = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
        else:
            nxt = logits.argmax(-1)
        positions = positions + 1
        mask = torch.cat([mask, torch.ones(len(rows), 1, dtype=mask.dtype, device=device)], dim=1)
        out = model.model(input_ids=nxt[:, None], attention_mask=mask, position_ids=positions[:, None],
                          cache=cache, use_cache=True)
        last = out.last_hidden_state[:, -1]
        made_rows.append(rows)
        made_tokens.append(nxt)
        made_feats.append(last.half())
        finished = finished | torch.isin(nxt, stops)
        if step == max_new_tokens - 1 or (step + 1) % check_every:
            continue
        if bool(finished.all()):
            break
        if bool(finished.any()):
            keep = (~finished).nonzero().squeeze(-1)
            cache.batch_select_indices(keep)
            mask, positions, last, rows, finished = mask[keep], positions[keep], last[keep], rows[keep], finished[keep]
    # One transfer, then each sample's answer in step order, cut after its first stop token.
    sample_of = torch.cat(made_rows).cpu()
    tokens = torch.cat(made_tokens).cpu()
    feats = torch.cat(made_feats).cpu()
    order = torch.argsort(sample_of, stable=True)
    spans = torch.bincount(sample_of, minlength=batch).cumsum(0).tolist()
    stops = stops.cpu()
    samples = []
    for b, p in enumerate(prompts):
        mine = order[(spans[b - 1] if b else 0): spans[b]]
        answer, answer_feats = tokens[mine], feats[mine]
        stopped = torch.isin(answer, stops).nonzero()
        if len(stopped):
            end = int(stopped[0]) + 1
            answer, answer_feats = answer[:end], answer_feats[:end]
        samples.append(Sample(
            ids=torch.cat([torch.tensor(p), answer]).to(torch.int32),
            hidden=torch.cat([prompt_feats[b, width - len(p):], answer_feats]),
            prompt_len=len(p),
        ))
    return samples


@torch.inference_mode()
def teacher_force(model: PreTrainedModel, prompt: list[int], answer: list[int]) -> Sample:
    """The target's features over a given prompt + answer (recorded traffic)."""
    ids = torch.tensor([prompt + answer], device=model.device)
    hidden = model.model(input_ids=ids).last_hidden_state[0]
    return Sample(ids=ids[0].to(torch.int32).cpu(), hidden=hidden.half().cpu(), prompt_len=len(prompt))


def save_shard(path: Path, samples: list[Sample], texts: list[dict[str, str]]) -> None:
    """Write one shard (atomically: a crash never leaves half a shard that resume would trust)."""
    lengths = torch.tensor([len(s.ids) for s in samples])
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    tensors = {
        "ids": torch.cat([s.ids for s in samples]),
        "hidden": torch.cat([s.hidden for s in samples]).contiguous(),
        "offsets": offsets,
        "prompt_lens": torch.tensor([s.prompt_len for s in samples], dtype=torch.long),
    }
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp))
    path.with_suffix(".jsonl").write_text("".join(json.dumps(t) + "\n" for t in texts))
    tmp.rename(path)


def load_shards(directory: Path) -> list[Sample]:
    """Every sample of every `*.safetensors` shard under `directory`, in file-name order."""
    samples = []
    for file in sorted(directory.glob("*.safetensors")):
        t = load_file(str(file))
        offsets = t["offsets"].tolist()
        for i, prompt_len in enumerate(t["prompt_lens"].tolist()):
            a, b = offsets[i], offsets[i + 1]
            samples.append(Sample(ids=t["ids"][a:b], hidden=t["hidden"][a:b], prompt_len=prompt_len))
    return samples


def _batches(items: list[int], size: int) -> Iterator[list[int]]:
    for start in range(0, len(items), size):
        yield items[start: start + size]


def build_self_distilled(
    directory: Path,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    *,
    batch_size: int,
    max_new_tokens: int,
    temperature: float | list[float] = 0.0,
    seed: int = 0,
    workers: int = 1,
    progress: bool = True,
    time_limit: float | None = None,
) -> list[Sample]:
    """Answer every prompt (shards already in `directory` are reused) and return all samples.

    Prompts are batched by token length so left padding stays small, and the batches are answered in
    an order shuffled with `seed`, so a run stopped early (`time_limit`: no batch starts after that
    many seconds) still covers prompts of every length. Shard i always holds the same prompts for the
    same inputs (a manifest refuses a directory made from other inputs), which is what makes resuming
    safe. A list of temperatures is taken in turn, batch by batch. `workers` > 1 forks that many
    single-threaded processes sharing the model's memory, each answering every workers-th batch: on a
    busy CPU, separate single-threaded processes outpaced one process with as many threads (measured,
    docs/distill.md).
    """
    directory.mkdir(parents=True, exist_ok=True)
    _check_manifest(directory, {"prompts": prompts, "batch_size": batch_size, "max_new_tokens": max_new_tokens,
                                "temperature": temperature, "seed": seed})
    encoded = [chat_ids(tokenizer, [{"role": "user", "content": p}]) for p in prompts]
    order = sorted(range(len(prompts)), key=lambda i: (len(encoded[i]), i))
    batches = list(_batches(order, batch_size))
    temperatures = temperature if isinstance(temperature, list) else [temperature]
    job = _AnswerJob(directory, model, tokenizer, prompts, encoded, batches, _stop_ids(model, tokenizer),
                     max_new_tokens, temperatures, seed)
    todo = [n for n in range(len(batches)) if not job.shard(n).exists()]
    random.Random(seed).shuffle(todo)
    deadline = None if time_limit is None else time.monotonic() + time_limit
    bar = _progress(len(batches), "answering prompts", progress)
    bar.update(len(batches) - len(todo))
    if workers <= 1 or len(todo) <= 1:
        for done, n in enumerate(todo):
            if deadline is not None and time.monotonic() > deadline:
                log.warning("answering stopped at its time limit: %d of %d batches left", len(todo) - done, len(todo))
                break
            job.run(n)
            bar.update(1)
    else:
        if deadline is not None:
            raise ValueError("a time limit needs a single answering process (workers = 1)")
        _run_forked(job, todo, workers, bar)
    bar.close()
    return load_shards(directory)


@dataclass
class _AnswerJob:
    """Everything needed to answer batch n and write its shard (shared by forked workers)."""

    directory: Path
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    prompts: list[str]
    encoded: list[list[int]]
    batches: list[list[int]]
    stop: set[int]
    max_new_tokens: int
    temperatures: list[float]
    seed: int

    def shard(self, n: int) -> Path:
        return self.directory / f"shard-{n:05d}.safetensors"

    def run(self, n: int) -> None:
        batch = self.batches[n]
        gen = torch.Generator(device=self.model.device).manual_seed(self.seed * 1_000_003 + n)
        temperature = self.temperatures[n % len(self.temperatures)]
        samples = answer_batch(self.model, [self.encoded[i] for i in batch], self.stop, self.max_new_tokens,
                               temperature, gen)
        texts = [
            {"prompt": self.prompts[i], "output": self.tokenizer.decode(s.ids[s.prompt_len:].tolist())}
            for i, s in zip(batch, samples, strict=True)
        ]
        save_shard(self.shard(n), samples, texts)


def _run_forked(job: _AnswerJob, todo: list[int], workers: int, bar) -> None:
    import multiprocessing

    def work(mine: list[int]) -> None:
        torch.set_num_threads(1)
        for n in mine:
            job.run(n)

    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=work, args=(todo[i::workers],)) for i in range(workers)]
    for proc in procs:
        proc.start()
    done = 0
    while any(proc.is_alive() for proc in procs):
        time.sleep(2.0)
        now = sum(job.shard(n).exists() for n in todo)
        bar.update(now - done)
        done = now
    failed = [proc.exitcode for proc in procs if proc.exitcode != 0]
    if failed:
        raise RuntimeError(f"answering worker failed (exit codes {failed})")
    bar.update(sum(job.shard(n).exists() for n in todo) - done)


def _check_manifest(directory: Path, inputs: dict) -> None:
    """Record what a data directory was made from; refuse to mix shards made from other inputs."""
    manifest = directory / "manifest.json"
    text = json.dumps(inputs, sort_keys=True)
    if manifest.exists():
        if manifest.read_text() != text:
            raise ValueError(f"{directory} holds data made from other prompts or settings; use another --out")
    else:
        manifest.write_text(text)


def build_from_traffic(
    directory: Path, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, traffic: str | Path,
    progress: bool = True,
) -> list[Sample]:
    """Teacher-force every recorded conversation once; cached as one shard in `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    shard = directory / "traffic.safetensors"
    if not shard.exists():
        records = read_traffic(traffic)
        samples, texts = [], []
        bar = _progress(len(records), "encoding traffic", progress)
        for r in records:
            if r.prompt_ids is not None and r.output_ids is not None:
                prompt, answer = r.prompt_ids, r.output_ids
            else:
                prompt = chat_ids(tokenizer, r.messages)
                answer = tokenizer.encode(r.output, add_special_tokens=False) + [tokenizer.eos_token_id]
            if answer:
                samples.append(teacher_force(model, prompt, answer))
                texts.append({"prompt": str(r.messages[-1].get("content")), "output": r.output})
            bar.update(1)
        bar.close()
        if not samples:
            raise ValueError(f"no traffic records (*.jsonl) under {traffic}")
        save_shard(shard, samples, texts)
    return load_shards(directory)


def token_counts(samples: list[Sample], vocab_size: int) -> torch.Tensor:
    """How often each token id occurs in the answers (the FR-Spec frequency table) [vocab_size]."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for s in samples:
        counts += torch.bincount(s.ids[s.prompt_len:].long(), minlength=vocab_size)
    return counts


def _progress(total: int, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, disable=not enabled, dynamic_ncols=True)
