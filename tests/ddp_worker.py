"""Worker for tests/train/test_ddp.py: trains a PLATE adapter on a tiny Qwen2 under torchrun (gloo, CPU) or alone.

python -m torch.distributed.run --nproc-per-node 2 tests/ddp_worker.py MODE MODEL BUNDLE OUT
MODE: trainer | accelerate | fsdp2 | accelerate_fsdp2 | fsdp2_meta | single. Every rank writes OUT/rank<R>.pt: A's,
a digest of B/Q, losses. accelerate_fsdp2: accelerate's FSDP2 preparation with cpu_ram_efficient_loading, rank 1's model
made on the meta device (a rank that loads nothing); fsdp2_meta: every rank's model made on meta, sharded, to_empty(),
the checkpoint broadcast from rank 0 (set_model_state_dict), then finish_meta_init.
The data: 4 fixed sequences; each step uses all of them (2 per rank, or 4 in one process), so a correct gradient
all-reduce makes every run equal to the single-process one.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

import torch

STEPS, LR = 3, 1e-2


def data() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 64, (4, 16), generator=g)


def plate_state(model: torch.nn.Module) -> dict:
    """A's by name and one digest over every B and Q (full tensors)."""
    from plate_inspect.train.peft import PlateLayer

    h = hashlib.sha256()
    a = {}
    for name, m in model.named_modules():
        if isinstance(m, PlateLayer):
            for key in m.plate_B_idx:
                h.update(m.plate_B_idx[key].cpu().numpy().tobytes())
                q = m.plate_Q[key]
                q = q.full_tensor() if hasattr(q, "full_tensor") else q
                h.update(q.detach().cpu().float().numpy().tobytes())
                p = m.plate_A[key]
                p = p.full_tensor() if hasattr(p, "full_tensor") else p
                a[name.replace("_fsdp_wrapped_module.", "")] = p.detach().cpu().clone()
    return {"A": a, "bq": h.hexdigest()}


def peft_model(model_dir: str, bundle: str):
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from plate_inspect.train.peft import PlateConfig

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    pm = get_peft_model(model, PlateConfig(bundle=bundle, task_type="CAUSAL_LM"))
    torch.manual_seed(0)
    return pm


def run_trainer(model_dir: str, bundle: str, world: int) -> tuple[torch.nn.Module, list[float]]:
    from transformers import Trainer, TrainingArguments

    pm = peft_model(model_dir, bundle)
    ids = data()
    # labels[0] is never a target (the loss shifts labels by one), so masking it leaves the loss as it is; it makes
    # transformers 4.x's Trainer divide the summed loss by the 60 tokens the loss has, not 64 (4.x counts the
    # unshifted labels, 5.x labels[..., 1:]): the hand-written loops' mean, which Adam's eps would otherwise tell apart
    ds = [{"input_ids": row, "labels": torch.cat([torch.tensor([-100]), row[1:]])} for row in ids]
    args = TrainingArguments(
        output_dir=os.environ.get("OUT_DIR", "/tmp") + "/trainer",
        per_device_train_batch_size=4 // world,
        max_steps=STEPS,
        learning_rate=LR,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=0.0,  # no clipping: the hand-written loops below do not clip either
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        ddp_backend="gloo" if world > 1 else None,
        logging_steps=1,
        disable_tqdm=True,
        seed=0,
    )
    trainer = Trainer(model=pm, args=args, train_dataset=ds)
    trainer.train()
    return pm, [h["loss"] for h in trainer.state.log_history if "loss" in h]


def run_accelerate(model_dir: str, bundle: str) -> tuple[torch.nn.Module, list[float]]:
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    pm = peft_model(model_dir, bundle)
    opt = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=LR, weight_decay=0.0)
    ids = data()
    loader = torch.utils.data.DataLoader(ids, batch_size=4 // acc.num_processes, shuffle=False)
    pm, opt, loader = acc.prepare(pm, opt, loader)
    losses = []
    for _ in range(STEPS):
        for batch in loader:
            loss = pm(input_ids=batch, labels=batch).loss
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(float(acc.gather(loss.detach()).mean()))
    return acc.unwrap_model(pm), losses


def run_fsdp2(model_dir: str, bundle: str) -> tuple[torch.nn.Module, list[float]]:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from plate_inspect.bundle import Bundle
    from plate_inspect.train.layer import check_module_against_record
    from plate_inspect.train.peft import PlateLayer

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    pm = peft_model(model_dir, bundle)  # the weight check runs here, on full weights, before sharding
    decoder = pm.base_model.model.model
    for layer in decoder.layers:
        fully_shard(layer)
    fully_shard(pm)
    b = Bundle.load(bundle)
    for name, m in pm.named_modules():  # and again on the sharded parameters (gathered full weights)
        if isinstance(m, PlateLayer):
            module = name.removeprefix("base_model.model.")
            assert hasattr(m.base_layer.weight, "full_tensor"), "parameters are not sharded"
            check_module_against_record(m.base_layer, module, b.record(module), True)
    return pm, _train_sharded(pm, rank, world)


def _train_sharded(pm: torch.nn.Module, rank: int, world: int) -> list[float]:
    import torch.distributed as dist

    opt = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=LR, weight_decay=0.0)
    ids = data()[rank * (4 // world) : (rank + 1) * (4 // world)]
    losses = []
    for _ in range(STEPS):
        loss = pm(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(float(t) / world)
    return losses


def _meta_model(model_dir: str) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))


def run_accelerate_fsdp2(model_dir: str, bundle: str) -> tuple[torch.nn.Module, list[float]]:
    import torch.distributed as dist
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from plate_inspect.train.peft import PlateConfig, PlateLayer

    acc = Accelerator(cpu=True)  # on CPU accelerate prepares DDP: its FSDP2 preparation is called directly
    acc.state.fsdp_plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        cpu_ram_efficient_loading=True,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["Qwen2DecoderLayer"],
        state_dict_type="FULL_STATE_DICT",
    )
    rank, world = dist.get_rank(), dist.get_world_size()
    model = AutoModelForCausalLM.from_pretrained(model_dir) if rank == 0 else _meta_model(model_dir)
    pm = get_peft_model(model, PlateConfig(bundle=bundle, task_type="CAUSAL_LM"))  # rank 1: checked at forward
    torch.manual_seed(0)
    if rank == 1:  # rotary inv_freq: non-persistent, accelerate keeps each rank's own (meta here): real ones
        rotary = pm.base_model.model.model.rotary_emb
        for name, buf in type(rotary)(config=model.config).named_buffers():
            rotary.register_buffer(name, buf, persistent=False)
    waiting = sum(len(m._awaiting) for m in pm.modules() if isinstance(m, PlateLayer))
    assert waiting == (14 if rank == 1 else 0), waiting  # rank 1's layers wait for the weights
    pm = fsdp2_prepare_model(acc, pm)
    losses = _train_sharded(pm, rank, world)
    assert not any(m._awaiting for m in pm.modules() if isinstance(m, PlateLayer))  # settled at the first forward
    return pm, losses


def run_fsdp2_meta(model_dir: str, bundle: str) -> tuple[torch.nn.Module, list[float]]:
    import torch.distributed as dist
    from peft import get_peft_model
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.fsdp import fully_shard

    from plate_inspect.train.layer import finish_meta_init
    from plate_inspect.train.peft import PlateConfig

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    pm = get_peft_model(_meta_model(model_dir), PlateConfig(bundle=bundle, task_type="CAUSAL_LM"))
    torch.manual_seed(0)
    inner = pm.base_model.model
    for layer in inner.model.layers:
        fully_shard(layer)
    fully_shard(pm)
    pm.to_empty(device="cpu")
    rotary = inner.model.rotary_emb  # non-persistent buffers: to_empty() leaves them uninitialised
    for name, buf in type(rotary)(config=inner.config).named_buffers():
        getattr(rotary, name).copy_(buf)
    full = {}
    if rank == 0:  # the checkpoint under the PEFT model's names (q_proj.weight -> q_proj.base_layer.weight)
        keys = set(pm.state_dict())
        for key, value in load_file(str(Path(model_dir) / "model.safetensors")).items():
            module, _, leaf = f"base_model.model.{key}".rpartition(".")
            wrapped = f"{module}.base_layer.{leaf}"
            full[wrapped if wrapped in keys else f"{module}.{leaf}"] = value
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
    set_model_state_dict(pm, full, options=options)
    assert finish_meta_init(pm) == 14  # weights checked (gathered), B/Q reloaded, A zeroed
    return pm, _train_sharded(pm, rank, world)


def main() -> None:
    mode, model_dir, bundle, out = sys.argv[1:5]
    os.environ["OUT_DIR"] = out
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    torch.manual_seed(0)
    if mode in ("trainer", "single"):
        model, losses = run_trainer(model_dir, bundle, world)
    elif mode == "accelerate":
        model, losses = run_accelerate(model_dir, bundle)
    elif mode == "fsdp2":
        model, losses = run_fsdp2(model_dir, bundle)
    elif mode == "accelerate_fsdp2":
        model, losses = run_accelerate_fsdp2(model_dir, bundle)
    elif mode == "fsdp2_meta":
        model, losses = run_fsdp2_meta(model_dir, bundle)
    else:
        raise SystemExit(f"unknown mode {mode}")
    state = plate_state(model)
    state.update(losses=losses, world=world)
    Path(out).mkdir(parents=True, exist_ok=True)
    torch.save(state, Path(out) / f"rank{rank}.pt")
    if torch.distributed.is_initialized():  # torn down before exit: gloo's threads dying with the interpreter
        torch.distributed.barrier()  # aborted a rank now and then ("terminate called without an active exception")
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
