"""HF transformers sequence-classification reward model from a local directory.

Score = the logit when the head has one label (a regression reward head), otherwise the
probability of the last label ("good").
"""

from __future__ import annotations

from typing import Any

from reward_servers.backends.base import BackendParams, model_dir, setup_torch
from reward_servers.backends.deps import require
from reward_servers.backends.weights import Weights


class SeqClsReward:
    def __init__(self, params: BackendParams) -> None:
        self.torch = setup_torch(params)
        tf = require("transformers")
        path = model_dir(params)
        self.tokenizer = tf.AutoTokenizer.from_pretrained(path)
        self.model = tf.AutoModelForSequenceClassification.from_pretrained(path).to(params.device).eval()
        self.weights = Weights(self.torch, [self.model], params.device)  # the host tier
        self.device = params.device
        self.max_len = params.max_seq_len

    def score(self, requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
        prompts = [r.get("prompt", "") for r in requests]
        responses = [r["response"] for r in requests]
        enc = self.tokenizer(
            prompts, responses, padding=True, truncation=True, max_length=self.max_len, return_tensors="pt"
        ).to(self.device)
        with self.torch.inference_mode():
            logits = self.model(**enc).logits.float()
        scores = logits[:, 0] if logits.shape[-1] == 1 else logits.softmax(-1)[:, -1]
        return [{"score": float(s)} for s in scores.cpu().tolist()]


def make(params: BackendParams) -> SeqClsReward:
    return SeqClsReward(params)
