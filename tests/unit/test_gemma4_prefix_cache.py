"""The prefix cache on Gemma 4 (``tiny-gemma4``): the model-level suite of
``test_hybrid_prefix_cache`` (tokens and every sampled row's logits with the cache equal those
without it, multi-turn, shared prefixes in a batch, chunked prefill ending on a checkpoint
boundary, salts and eviction, no checkpoints means no cache, the checkpoint pool booked) run
again here, where the sliding rings that are checkpointed and restored are also read by the
KV-shared layers, and the paged global layer's blocks by its reader."""

from __future__ import annotations

import pytest
from unit.test_hybrid_prefix_cache import (  # noqa: F401  (collected here with this module's ``path``)
    test_chunked_prefill_ends_on_the_checkpoint_boundary,
    test_multi_turn_identical_and_cached_counts_exact,
    test_no_checkpoints_means_no_prefix_cache,
    test_salts_and_eviction,
    test_shared_prefix_across_requests_and_batching,
    test_the_checkpoint_pool_is_booked,
)


@pytest.fixture(scope="module")
def path(model_factory):
    return str(model_factory("tiny-gemma4", dtype="float32"))
