"""The maths functions' shape, rank and dtype contracts (grpo_jax/losses/contracts.py), jitted and not: a wrong
array fails while tracing with the names of the arrays and the shapes they must have, and the right ones give the
naive loop's numbers."""

import chex
import jax.numpy as jnp
import numpy as np

from grpo_jax.algo.advantages import group_advantages
from grpo_jax.algo.trajectory import Trajectory
from grpo_jax.losses import LossConfig, aggregate, compute_loss, contracts, kl_divergence, log_importance_weights

B, T = 3, 5
RNG = np.random.default_rng(0)
LOGP = jnp.asarray(-RNG.uniform(0.1, 2.0, (B, T)), jnp.float32)
OLD = jnp.asarray(LOGP + RNG.normal(0, 0.4, (B, T)), jnp.float32)  # some ratios past the clip
MASK = jnp.asarray((np.arange(T)[None] < np.array([[5], [3], [1]])).astype(np.int32))
ADV = jnp.asarray([1.0, -0.5, 0.25], jnp.float32)


def _loss(logp, old, adv, mask):
    return compute_loss(logp, old, None, adv, mask, config=LossConfig(beta=0.0, loss_type="dapo"))[0]


class ContractsTest(chex.TestCase):

    @chex.variants(with_jit=True, without_jit=True)
    def test_compute_loss_names_the_array_that_does_not_fit(self):
        loss = self.variant(_loss)
        with self.assertRaisesRegex(AssertionError, r"advantages must be \[B\]=3 rows or \[B, T\]=\(3, 5\)"):
            loss(LOGP, OLD, ADV[:2], MASK)
        with self.assertRaisesRegex(AssertionError, r"advantages must be \[B\] or \[B, T\]"):
            loss(LOGP, OLD, ADV[:, None, None], MASK)
        with self.assertRaisesRegex(AssertionError, r"per_token_logps, old_per_token_logps, completion_mask must share "
                                                    r"one \[B, T\] shape"):
            loss(LOGP, OLD[:, :4], ADV, MASK)
        with self.assertRaisesRegex(AssertionError, r"completion_mask must be \[B, T\]"):
            loss(LOGP, OLD, ADV, MASK[0])
        with self.assertRaisesRegex(AssertionError, r"per_token_logps holds int32, not floats"):
            loss(MASK, OLD, ADV, MASK)

    @chex.variants(with_jit=True, without_jit=True)
    def test_the_pieces_and_the_advantages_name_theirs(self):
        with self.assertRaisesRegex(AssertionError, r"per_token_logps, old_per_token_logps must share one shape"):
            self.variant(log_importance_weights)(LOGP, OLD[:2])
        with self.assertRaisesRegex(AssertionError, r"per_token_logps, ref_per_token_logps must share one shape"):
            self.variant(kl_divergence)(LOGP, OLD.T)
        with self.assertRaisesRegex(AssertionError, r"per_token_loss \(3, 4\) must be \[B, T\] or \[B, 1\]"):
            self.variant(lambda l, m: aggregate(l, m, loss_type="dapo"))(LOGP[:, :4], MASK)
        with self.assertRaisesRegex(AssertionError, r"reward_weights must hold one weight per reward function"):
            self.variant(lambda r, w: group_advantages(r, w, num_generations=2)[0])(jnp.ones((4, 2)), jnp.ones(3))

    @chex.variants(with_jit=True, without_jit=True)
    def test_a_train_steps_rows_are_checked_by_name(self):
        rows = Trajectory(jnp.zeros((B, 4), jnp.int32), jnp.ones((B, 4), jnp.int32), jnp.zeros((B, T), jnp.int32),
                          MASK, MASK, OLD, jnp.zeros((B, T), jnp.int32), jnp.zeros(B, bool), advantages=ADV)
        check = self.variant(lambda rows: contracts.trajectory(rows) or 0)
        check(rows)
        with self.assertRaisesRegex(AssertionError, r"loss_mask.* must share one \[B, T\] shape"):
            check(rows._replace(loss_mask=MASK[:, :4]))
        with self.assertRaisesRegex(AssertionError, r"is_truncated must be \[B\]=3"):
            check(rows._replace(is_truncated=jnp.zeros(B + 1, bool)))
        with self.assertRaisesRegex(AssertionError, r"prompt_ids must have the completions' B=3 rows"):
            check(rows._replace(prompt_ids=jnp.zeros((B + 1, 4), jnp.int32), prompt_mask=jnp.ones((B + 1, 4))))

    @chex.variants(with_jit=True, without_jit=True)
    def test_right_arrays_give_the_naive_numbers(self):
        """DAPO with old log-probs (ratios inside and past the clip): Σ_t -min(r A, clip(r) A) m / Σ m, the naive loop's, jitted or not."""
        got = self.variant(_loss)(LOGP, OLD, ADV, MASK)
        want, count = 0.0, 0
        for b, t in np.ndindex(B, T):
            if MASK[b, t]:
                r = float(np.exp(LOGP[b, t] - OLD[b, t]))
                want += -min(r * float(ADV[b]), float(np.clip(r, 0.8, 1.2)) * float(ADV[b]))
                count += 1
        chex.assert_trees_all_close(got, jnp.float32(want / count), rtol=1e-5)
        chex.assert_trees_all_close(self.variant(log_importance_weights)(LOGP, OLD), LOGP - OLD)
