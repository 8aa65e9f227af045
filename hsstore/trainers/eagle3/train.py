"""Train an EAGLE-3 drafter on an hsstore dataset, streamed by ``hsstore.loader``.

    python -m hsstore.trainers.eagle3 --data DS [--target MODEL_DIR] --steps N --out DIR [--resume]

Read top to bottom: options, batch alignment, targets and loss, then the loop. One process per
GPU under torchrun (rank and world size come from the environment and go to the loader, which
gives each rank its own batches); plain ``python`` runs one process on GPU or CPU.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from hsstore.commits.runs import completion
from hsstore.spec.layers import verifier_position
from hsstore.trainers.eagle3.acceptance import predict_for_run
from hsstore.trainers.eagle3.batches import align_batch, shift_left, step_validity
from hsstore.trainers.eagle3.checkpoint import (
    find_checkpoint,
    load_drafter,
    load_trainer_state,
    save_checkpoint,
    server_config,
    target_architecture_of,
)
from hsstore.trainers.eagle3.following import wait_for_dataset, wait_for_samples
from hsstore.trainers.eagle3.model import (
    Eagle3Drafter,
    TargetHead,
    drafter_config_from_target,
    load_target_tensors,
)
from hsstore.trainers.eagle3.vocab import VocabMaps, build_vocab_maps, dataset_token_counts


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m hsstore.trainers.eagle3", description=__doc__.split("\n")[0]
    )
    p.add_argument("--data", required=True, help="hsstore dataset: a path or s3/gs/az URL")
    p.add_argument("--target", help="target model dir (safetensors): soft targets + embedding")
    p.add_argument("--out", required=True, help="output directory (checkpoint/ goes here)")
    p.add_argument("--steps", type=int, required=True, help="optimizer steps in the whole run")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint")
    p.add_argument("--stop-after", type=int, help="save and exit after this many steps (job limit)")
    p.add_argument(
        "--follow",
        action="store_true",
        help="train while the dataset is extracted: a first pass over samples as they are "
        "committed, until the extraction records that it is complete",
    )
    p.add_argument(
        "--follow-window",
        type=int,
        default=256,
        help="with --follow: new samples that make a shuffled window of the first pass",
    )
    p.add_argument(
        "--follow-timeout",
        type=float,
        default=None,
        help="with --follow: give up after this many seconds without a new commit",
    )
    p.add_argument(
        "--epochs",
        type=int,
        default=None,
        help="stop at the end of this many epochs (with --follow the first pass is epoch 0; "
        "default: --follow stops after the first pass, otherwise --steps decides)",
    )
    p.add_argument("--max-tokens", type=int, default=2048, help="tokens per packed batch")
    p.add_argument("--ttt-steps", type=int, default=3, help="draft steps unrolled in training")
    p.add_argument("--step-decay", type=float, default=0.8, help="loss weight of step s: decay**s")
    p.add_argument("--draft-vocab-size", type=int, default=32000)
    p.add_argument("--vocab-samples", type=int, default=0, help="count only N samples (0 = all)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--warmup", type=int, default=0, help="linear warmup steps, then cosine to 10%%")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--grad-clip", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--save-every", type=int, default=0, help="0 = only at the end")
    p.add_argument(
        "--skip-damaged",
        action="store_true",
        help="train past samples that fail their checks (checksum, decode): each is named, "
        "blanked in its batch (no loss) and counted in the summary; default: stop",
    )
    p.add_argument("--prefetch", type=int, default=2)
    p.add_argument("--num-threads", type=int, default=4, help="loader decode threads")
    p.add_argument("--device", help="default: cuda:LOCAL_RANK if available, else cpu")
    p.add_argument(
        "--eval-data",
        help="held-out dataset (same layers) to predict serving acceptance on at the end "
        "(default: the first samples of --data, which the drafter was trained on)",
    )
    p.add_argument("--eval-samples", type=int, default=64, help="samples of that prediction")
    p.add_argument(
        "--eval-draft-tokens",
        type=int,
        help="draft tokens per step of the engine (default: --ttt-steps)",
    )
    p.add_argument("--samples-log", help="write each step's sample positions to PATH.rank<R>.jsonl")
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------
# Targets and loss. After alignment, step s at position i drafts the token at position i+s+1.
# It counts only if that token is a loss token of the same document. The target is either the
# target model's distribution there (the stored last state at i+s through its norm + lm_head,
# restricted to the draft vocabulary) or, without a target model, that token itself.


def ttt_loss(
    logits: list[torch.Tensor],  # per step [1, T, D]
    view: dict,
    vocab: VocabMaps,
    head: TargetHead | None,
    decay: float,
) -> tuple[torch.Tensor, list[float], list[int]]:
    """Weighted sum over steps of the per-step loss; returns (loss, top-1 acc per step, counts).

    With a target head: KL(target || draft) over the draft vocabulary, the standard EAGLE-3
    distillation loss. Without: cross-entropy against the next token (tokens outside the draft
    vocabulary cannot be drafted and are left out).
    """
    valid = step_validity(view, len(logits))
    if head is not None:
        target_logp = F.log_softmax(head(view["verifier"][0]), dim=-1)  # [T, D]
    else:
        to_draft = vocab.target_to_draft.to(view["input_ids"].device)
        next_draft = to_draft[view["input_ids"][0]]  # draft id of the token at i, or -1
    total = torch.zeros((), device=logits[0].device)  # float32 even under bf16 autocast
    accs, counts = [], []
    for s, step_logits in enumerate(logits):
        lg = step_logits[0].float()
        if head is not None:
            tgt_logp, ok = shift_left(target_logp, s), valid[s]
            tgt_ids = tgt_logp.argmax(-1)
        else:
            tgt_ids = shift_left(next_draft, s + 1)
            ok = valid[s] & (tgt_ids >= 0)
        n = int(ok.sum())
        counts.append(n)
        if n == 0:
            accs.append(float("nan"))
            total = total + 0.0 * lg.sum()  # keep every parameter in the graph (DDP)
            continue
        logp = F.log_softmax(lg[ok], dim=-1)
        if head is not None:
            p = tgt_logp[ok].exp()
            step_loss = (p * (tgt_logp[ok] - logp)).sum(-1).mean()
        else:
            step_loss = F.nll_loss(logp, tgt_ids[ok])
        total = total + decay**s * step_loss
        accs.append((logp.argmax(-1) == tgt_ids[ok]).float().mean().item())
    return total, accs, counts


# ---------------------------------------------------------------------------------------------
# Setup helpers.


def distributed_setup() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from torchrun's environment; init the process group."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_RANK", 0))
    if world > 1 and not torch.distributed.is_initialized():
        # torch.distributed.nn's functions take ``group=group.WORLD`` as a default argument,
        # evaluated when that module is first imported, which constructing DDP does (through
        # torch._dynamo). Imported once the group exists, they would hold it for the life of
        # the interpreter: destroy_process_group() could not free it, and gloo's threads and
        # connections would be torn down only while the interpreter finalizes (as the other
        # rank exits too), where a thread that needs the interpreter is ended mid-call and
        # aborts the process. Imported first, those defaults are None.
        from torch.distributed import nn as _defaults_of_none  # noqa: F401

        backend = "nccl" if torch.cuda.is_available() else "gloo"
        torch.distributed.init_process_group(backend)
    return rank, world, local


def split_layers(
    layers: list, num_hidden_layers: int | None, need_last: bool
) -> tuple[list[int], int]:
    """(positions of aux layers, position of the verifier layer) in ``ds.layers``.

    The verifier is the deepest stored state (the loader's default); the rest are aux layers,
    in ascending depth whatever their stored order: vLLM (``set_aux_hidden_state_layers`` sorts
    the ids) and SGLang (captures in the order of the decoder-layer loop, ``models/llama.py``)
    both concatenate the aux states for ``fc`` shallowest first. Soft targets need the verifier
    to be the target's last layer; next-token training does not use it.
    """
    deepest = verifier_position(layers)
    if need_last and num_hidden_layers is not None and layers[deepest].depth != num_hidden_layers:
        raise ValueError(
            f"deepest stored layer has depth {layers[deepest].depth}, the model has "
            f"{num_hidden_layers} layers: no last-layer state to distill from"
        )
    aux = [i for i in range(len(layers)) if i != deepest]
    return sorted(aux, key=lambda i: (layers[i].depth, layers[i].final_norm)), deepest


def lr_at(step: int, args: argparse.Namespace) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def skipped_on_every_rank(mine: list[str], world: int) -> list[str]:
    """The damaged samples any rank blanked (its loader's state: this run's and those of the
    run it resumed), each once, sorted."""
    found = [mine]
    if world > 1:
        found = [[] for _ in range(world)]
        torch.distributed.all_gather_object(found, mine)
    return sorted({sid for ids in found for sid in ids})


def _window_mean(values: list[float], first: bool) -> float:
    """Mean of the first or last tenth of a run (at least 1, at most 20 steps): one batch is
    too noisy to compare the start and the end of a run."""
    w = max(1, min(20, len(values) // 10))
    chunk = [v for v in (values[:w] if first else values[-w:]) if not math.isnan(v)]
    return sum(chunk) / len(chunk) if chunk else float("nan")


# ---------------------------------------------------------------------------------------------
# The run.


def train(args: argparse.Namespace) -> dict:
    import hsstore
    from hsstore.loader import Loader

    rank, world, local_rank = distributed_setup()
    master = rank == 0
    if args.device:
        device = torch.device(args.device)
    else:
        device = torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    # Dataset: which stored layers feed fc, which one is the target's last state.
    ds = (
        wait_for_dataset(args.data, args.follow_timeout) if args.follow else hsstore.open(args.data)
    )
    num_layers = ds.manifest.model.num_hidden_layers
    aux_pos, verifier_pos = split_layers(ds.layers, num_layers, need_last=bool(args.target))
    aux_specs = [ds.layers[i] for i in aux_pos]
    verifier_spec = ds.layers[verifier_pos]
    vocab_size = int(ds.manifest.model.vocab_size or 0)

    # The drafter: restored from the checkpoint on --resume, else built fresh.
    ckpt = find_checkpoint(out) if args.resume else None
    if args.resume and ckpt is None and master:
        print(f"no checkpoint in {out}, starting fresh")
    target_tensors, target_config = ({}, None)
    if args.target:
        target_tensors, target_config = load_target_tensors(args.target)
        vocab_size, width = target_tensors["embed"].shape
        if width != ds.manifest.hidden_size:
            raise ValueError(
                f"--target has hidden size {width}, the dataset stores {ds.manifest.hidden_size}"
            )
    if ckpt is not None:
        model, _ = load_drafter(ckpt)
        cfg = model.config
        vocab = VocabMaps(d2t=model.d2t.clone(), t2d=model.t2d.clone())
    else:
        if not vocab_size:
            raise ValueError("dataset manifest has no model.vocab_size; pass --target")
        if args.follow:
            ds = wait_for_samples(ds, args.follow_window, args.follow_timeout)
        counts = dataset_token_counts(ds, vocab_size, args.vocab_samples)
        vocab = build_vocab_maps(counts, args.draft_vocab_size)
        cfg = drafter_config_from_target(
            target_config,
            hidden_size=ds.manifest.hidden_size,
            vocab_size=vocab_size,
            num_aux_layers=len(aux_pos),
            draft_vocab_size=args.draft_vocab_size,
        )
        model = Eagle3Drafter(cfg)
        model.d2t.copy_(vocab.d2t)
        model.t2d.copy_(vocab.t2d)
        if args.target:
            model.embed_tokens.weight.data.copy_(target_tensors["embed"].float())
    if args.target:  # the target's embedding is shared at inference: keep it frozen
        model.embed_tokens.weight.requires_grad_(False)

    head = None
    if args.target:
        head = TargetHead(
            target_tensors["norm"],
            target_tensors["head"][vocab.draft_to_target],
            eps=float(target_config.get("rms_norm_eps", 1e-6)),
            apply_norm=not verifier_spec.final_norm,
        ).to(device)
    model.to(device)
    ddp_model = model
    if world > 1:
        ddp_model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None
        )
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        params, lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.95)
    )

    loader = Loader(
        args.data,
        max_tokens=args.max_tokens,
        shuffle=True,
        seed=args.seed,
        device=device if device.type == "cuda" else None,
        aux_layers=aux_pos,
        verifier=head is not None,  # next-token training never reads the last state
        rank=rank,
        world_size=world,
        prefetch=args.prefetch,
        num_threads=args.num_threads,
        follow=args.follow,
        follow_window=args.follow_window,
        follow_timeout_s=args.follow_timeout,
        skip_damaged=args.skip_damaged,
    )
    start_step = 0
    if ckpt is not None:
        state = load_trainer_state(ckpt)
        optimizer.load_state_dict(state["optimizer"])
        loader.load_state_dict(state["loader"])
        torch.set_rng_state(state["rng"])
        start_step = state["step"]
        if master:
            print(f"resumed from {ckpt} at step {start_step}")
    config_json = server_config(
        cfg,
        aux_specs,
        verifier_spec,
        num_layers or verifier_spec.depth,
        extra={"dataset": str(args.data), "ttt_steps": args.ttt_steps, "target": args.target},
        target_architecture=target_architecture_of(args.target or ds.manifest.model.name),
    )

    def checkpoint(step: int) -> None:
        if master:
            state = {
                "step": step,
                "optimizer": optimizer.state_dict(),
                "loader": loader.state_dict(),
                "rng": torch.get_rng_state(),
                "args": vars(args),
            }
            save_checkpoint(out, model, config_json, state)
        if world > 1:
            torch.distributed.barrier()

    # The loop. Data wait = time blocked on the loader; with prefetch it should be near zero.
    use_bf16 = device.type == "cuda"
    history: list[dict] = []
    # One iterator across epochs, from the loader's (possibly restored) position: the loader
    # decodes the next epoch's first batches while this one's last steps train.
    epochs = args.epochs if args.epochs is not None else (1 if args.follow else None)
    batches = loader.iter_epochs(epochs)
    if args.follow and master:
        done = completion(ds.refresh().manifest.provenance)
        print(
            f"following {args.data} from version {loader.first_pass.state.start_version} "
            f"({len(ds)} samples now; extraction {'complete' if done.complete else 'running'})",
            flush=True,
        )
    wait_total, run_start = 0.0, time.perf_counter()
    first_batch_at = None  # wall clock (time.time), comparable with other processes' clocks
    stop = min(args.steps, start_step + args.stop_after) if args.stop_after else args.steps
    log_path = args.samples_log and f"{args.samples_log}.rank{rank}.jsonl"
    samples_log = open(log_path, "w", buffering=1) if log_path else None  # noqa: SIM115
    model.train()
    for step in range(start_step, stop):
        t0 = time.perf_counter()
        batch = next(batches, None)
        t1 = time.perf_counter()
        if batch is None:  # the last epoch ended (every rank at the same step: tail="pad")
            stop = step
            break
        if first_batch_at is None:
            first_batch_at = time.time()
        epoch, global_batch, repeat = loader.last_batch or (loader.epoch, -1, False)
        view = align_batch({k: v.to(device, non_blocking=True) for k, v in batch.items()})
        aux = view["aux"] if use_bf16 else view["aux"].float()
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16):
            logits = ddp_model(
                view["input_ids"], aux, view["position_ids"], view["document_ids"], args.ttt_steps
            )
        loss, accs, counts = ttt_loss(logits, view, vocab, head, args.step_decay)  # float32
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, args.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss_value = loss.item()  # also waits for the GPU, so step timing is honest
        t2 = time.perf_counter()

        wait_total += t1 - t0
        tokens = int(batch["lengths"].sum())
        history.append(
            {
                "step": step + 1,
                "loss": loss_value,
                "acc": accs,
                "scored": counts,  # positions scored per draft step
                "tokens": tokens,
                "wait": t1 - t0,
                "time": t2 - t0,
                "samples": batch["sample_index"].tolist() if "sample_index" in batch else None,
                "epoch": epoch,
                "batch": global_batch,  # of the epoch's global batch list
                "repeat": repeat,  # a batch repeated to pad the epoch's last round
            }
        )
        if samples_log is not None:  # line-buffered: a killed run's log has each step it trained
            keys = ("step", "samples", "epoch", "batch", "repeat")
            samples_log.write(json.dumps({k: history[-1][k] for k in keys}) + "\n")
        if master and ((step + 1) % args.log_every == 0 or step + 1 == stop):
            recent = history[-args.log_every :]
            tok_s = sum(h["tokens"] for h in recent) / max(1e-9, sum(h["time"] for h in recent))
            wait = sum(h["wait"] for h in recent) / max(1e-9, sum(h["time"] for h in recent))
            acc_text = " ".join(f"{a:.3f}" for a in accs)
            print(
                f"step {step + 1}/{args.steps} | loss {loss_value:.4f} | acc/step {acc_text} | "
                f"{tok_s:,.0f} tok/s | data wait {100 * wait:.1f}%",
                flush=True,
            )
        if args.save_every and (step + 1) % args.save_every == 0 and step + 1 < stop:
            checkpoint(step + 1)
    loader.close()  # stops the decode threads now, not at garbage collection
    if stop > start_step:
        checkpoint(stop)

    elapsed = time.perf_counter() - run_start
    acceptance = None
    if master and args.eval_samples > 0:
        acceptance = predict_for_run(args, model, aux_pos, target_tensors, head, device)
    losses = [h["loss"] for h in history]
    mean_accs = [sum(h["acc"]) / len(h["acc"]) for h in history]  # nan if any step had none
    summary = {
        "loss_first": _window_mean(losses, first=True),
        "loss_last": _window_mean(losses, first=False),
        "acc_first": _window_mean(mean_accs, first=True),
        "acc_last": _window_mean(mean_accs, first=False),
        "acc_per_step_last": [None if math.isnan(a) else a for a in history[-1]["acc"]]
        if history
        else [],
        "data_wait_frac": wait_total / max(1e-9, elapsed),
        "tokens_per_s": sum(h["tokens"] for h in history) / max(1e-9, elapsed),
        "steps": len(history),
        "first_step": start_step + 1,
        "epoch": loader.epoch,
        "first_batch_time": first_batch_at,
        "extraction_complete": completion(ds.refresh().manifest.provenance).complete,
        "acceptance": acceptance,
    }
    summary["skipped_samples"] = skipped_on_every_rank(loader.skipped, world)
    summary["left_out_samples"] = loader.left_out  # the same view on every rank
    if samples_log is not None:
        samples_log.close()
    if world > 1:
        del ddp_model  # its reducer holds the group too: the group is freed, its threads joined
        torch.distributed.destroy_process_group()
    return {"summary": summary, "history": history, "checkpoint": str(out / "checkpoint")}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    result = train(args)
    if int(os.environ.get("RANK", 0)) == 0:
        print(json.dumps(result["summary"]), flush=True)
    return result
