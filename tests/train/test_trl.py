"""TRL's SFTTrainer with peft_config=PlateConfig(bundle=...) on a small Qwen2 (random init, real architecture).

Slow: about a minute on a busy 2-core machine (run with -m slow).
"""

from __future__ import annotations

import math

import pytest
import torch
from peft import PeftModel

from plate_inspect import scan
from plate_inspect.train.peft import PlateConfig, PlateLayer

VOCAB = 48


def _tokenizer():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(VOCAB - 2)} | {"<pad>": VOCAB - 2, "<eos>": VOCAB - 1}
    tok = Tokenizer(WordLevel(vocab, unk_token="<pad>"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


@pytest.mark.slow
def test_sft_trainer_trains_only_a_and_the_adapter_round_trips(tmp_path):
    from datasets import Dataset
    from helpers_train import save_tiny_qwen2
    from transformers import AutoModelForCausalLM
    from trl import SFTConfig, SFTTrainer

    save_tiny_qwen2(tmp_path / "model", vocab=VOCAB, intermediate=64)
    bundle = scan(tmp_path / "model", tmp_path / "bundle", r=8, tau=0.9, max_rank=32)
    g = torch.Generator().manual_seed(1)
    starts = torch.randint(0, VOCAB - 2, (64,), generator=g)
    rows = [[(int(s) + 3 * i) % (VOCAB - 2) for i in range(16)] for s in starts]  # a learnable pattern
    data = Dataset.from_dict({"input_ids": rows})
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = SFTConfig(
        output_dir=str(tmp_path / "out"),
        max_steps=12,
        per_device_train_batch_size=8,
        learning_rate=1e-1,
        lr_scheduler_type="constant",
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        dataset_num_proc=None,
        seed=0,
        bf16=False,  # TRL defaults to bf16 autocast where supported; float32 makes the round trip exact
    )
    trainer = SFTTrainer(
        model=model,
        args=args,
        train_dataset=data,
        processing_class=_tokenizer(),
        peft_config=PlateConfig(bundle=str(bundle.path), task_type="CAUSAL_LM"),
    )
    pm = trainer.model
    assert sum(isinstance(m, PlateLayer) for m in pm.modules()) == len(bundle) == 14
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 12
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.05, losses  # the loss went down
    for n, p in pm.named_parameters():
        if "plate_A" in n:
            assert p.abs().sum() > 0, n
        else:
            key = n.removeprefix("base_model.model.").replace(".base_layer", "")
            assert torch.equal(p, before[key]), n  # only A changed
    pm.save_pretrained(tmp_path / "adapter")
    ids = torch.tensor([rows[0]])
    pm.eval()
    with torch.no_grad():
        out = pm(input_ids=ids).logits
        fresh = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
        loaded = PeftModel.from_pretrained(fresh, tmp_path / "adapter")
        a_loaded = dict(loaded.named_parameters())
        for n, p in pm.named_parameters():
            if "plate_A" in n:
                assert torch.equal(a_loaded[n], p), n
        torch.testing.assert_close(loaded(input_ids=ids).logits, out, rtol=0, atol=0)


@pytest.mark.slow
def test_dpo_trainer_with_a_plate_config_moves_the_policy_off_the_base_reference(tmp_path):
    """DPOTrainer(peft_config=PlateConfig(...)): the reference is the base model (adapter disabled), so the first
    loss is log 2 exactly (A = 0), then it falls and the chosen-rejected reward margin grows; only A changes."""
    from datasets import Dataset
    from helpers_train import save_tiny_qwen2
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import AutoModelForCausalLM
    from trl import DPOConfig, DPOTrainer

    save_tiny_qwen2(tmp_path / "model", vocab=VOCAB, intermediate=64)
    bundle = scan(tmp_path / "model", tmp_path / "bundle", r=8, tau=0.9, max_rank=32)
    tok = _tokenizer()
    tok.backend_tokenizer.pre_tokenizer = Whitespace()  # "t1 t2" -> two tokens
    prompts = [" ".join(f"t{(3 * i + j) % 40}" for j in range(6)) for i in range(16)]
    data = Dataset.from_dict({"prompt": prompts, "chosen": [" t1 t2"] * 16, "rejected": [" t9 t8"] * 16})
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = DPOConfig(
        output_dir=str(tmp_path / "out"),
        max_steps=6,
        per_device_train_batch_size=4,
        learning_rate=5e-2,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        bf16=False,
        seed=0,
    )
    config = PlateConfig(bundle=str(bundle.path), task_type="CAUSAL_LM")
    trainer = DPOTrainer(model=model, args=args, train_dataset=data, processing_class=tok, peft_config=config)
    assert trainer.ref_model is None and sum(isinstance(m, PlateLayer) for m in trainer.model.modules()) == 14
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert abs(logs[0]["loss"] - math.log(2)) < 1e-4  # A = 0: policy = reference
    assert logs[-1]["loss"] < logs[0]["loss"] - 0.03 and logs[-1]["rewards/margins"] > 0.05, logs
    for n, p in trainer.model.named_parameters():
        if "plate_A" not in n:
            key = n.removeprefix("base_model.model.").replace(".base_layer", "")
            assert torch.equal(p, before[key]), n
