"""The held-out cross entropy of conversations: how well a model predicts the assistant's turns of reference
conversations (reasoning included), by domain. The pipeline measures every stage's model this way; it is the same
computation as a training run's validation loss (`hybridtron.train.evaluate.held_out_ce`), on unpacked
conversations, one a row."""

from __future__ import annotations

import torch

from hybridtron.data.batch import TokenBatch
from hybridtron.data.chat import tokenize_chats
from hybridtron.ops.cross_entropy import IGNORE_INDEX
from hybridtron.train.evaluate import held_out_ce


def conversation_batches(tokenizer, conversations: list[dict], max_positions: int) -> list[TokenBatch]:
    """Each conversation ({"messages": [...]}) as a one-row `TokenBatch` (alone in its row: no seq_idx needed), cut
    at `max_positions`: the labels are the next tokens of the assistant's turns (reasoning included), IGNORE_INDEX
    elsewhere. A conversation with nothing to score is left out."""
    batches = []
    for chat in tokenize_chats(tokenizer, [c["messages"] for c in conversations]):
        ids = torch.as_tensor(chat.ids[:max_positions], dtype=torch.long)
        trained = torch.as_tensor(chat.trained(train_on_thinking=True)[:max_positions])
        labels = torch.where(trained[1:], ids[1:], IGNORE_INDEX)
        if (labels != IGNORE_INDEX).any():
            batches.append(TokenBatch(ids[None, :-1], labels[None]))
    return batches


def held_out_loss(model, tokenizer, conversations_by_domain: dict[str, list[dict]]) -> dict[str, float]:
    """{domain: CE per scored token, ...} and "all": the token-weighted CE over every domain's conversations."""
    values, total, count = {}, 0.0, 0.0
    for domain, conversations in conversations_by_domain.items():
        results = held_out_ce(model, conversation_batches(tokenizer, conversations,
                                                          model.config.max_position_embeddings))
        domain_sum, domain_count = sum(s for s, _ in results), sum(c for _, c in results)
        values[domain] = domain_sum / max(domain_count, 1)
        total, count = total + domain_sum, count + domain_count
    values["all"] = total / max(count, 1)
    return values
