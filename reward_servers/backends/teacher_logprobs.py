"""Teacher per-token log-probabilities of a causal LM from a local directory (the MOPD case).

For each request, the log-probability (natural log) under the teacher of every response token
given the prompt and the response tokens before it.
"""

from __future__ import annotations

from typing import Any

from reward_servers.backends.base import BackendParams, model_dir, setup_torch
from reward_servers.backends.deps import require
from reward_servers.backends.weights import Weights


class TeacherLogprobs:
    def __init__(self, params: BackendParams) -> None:
        self.torch = setup_torch(params)
        tf = require("transformers")
        path = model_dir(params)
        self.tokenizer = tf.AutoTokenizer.from_pretrained(path)
        self.model = tf.AutoModelForCausalLM.from_pretrained(path).to(params.device).eval()
        self.weights = Weights(self.torch, [self.model], params.device)  # the host tier
        self.device = params.device
        self.max_len = params.max_seq_len
        self.pad_id = self.tokenizer.pad_token_id
        if self.pad_id is None:
            self.pad_id = self.tokenizer.eos_token_id or 0

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def score(self, requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
        torch = self.torch
        rows: list[tuple[list[int], int]] = []  # (ids, number of prompt tokens)
        for r in requests:
            prompt, response = self._ids(r["prompt"]), self._ids(r["response"])
            ids = (prompt + response)[-self.max_len :]  # keep the response, cut the prompt's head
            rows.append((ids, max(1, len(ids) - len(response))))
        width = max(len(ids) for ids, _ in rows)
        input_ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, (ids, _) in enumerate(rows):  # right padding: positions stay 0..len-1
            input_ids[i, : len(ids)] = torch.tensor(ids)
            mask[i, : len(ids)] = 1
        with torch.inference_mode():
            logits = self.model(
                input_ids=input_ids.to(self.device), attention_mask=mask.to(self.device)
            ).logits
            logp = logits.float().log_softmax(-1)
            # token t is predicted by position t-1
            tok = logp[:, :-1].gather(-1, input_ids[:, 1:].to(self.device).unsqueeze(-1)).squeeze(-1)
        out = []
        for i, (ids, start) in enumerate(rows):
            lp = tok[i, start - 1 : len(ids) - 1].cpu().tolist()
            out.append({"logprobs": lp, "num_tokens": len(lp), "sum_logprob": float(sum(lp))})
        return out


def make(params: BackendParams) -> TeacherLogprobs:
    return TeacherLogprobs(params)
