"""The CPU example's reward: 1 when the last number of the response is the answer (the built-in
`gsm8k_flexible` scorer). The 135M model rarely reaches "#### n" within the CPU run's short responses;
the last number is a signal it can improve on within a few steps. The GPU run scores strictly ("####")."""

from shardrl.rewards.manager import gsm8k_flexible_score


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return gsm8k_flexible_score(data_source, solution_str, ground_truth, extra_info)
