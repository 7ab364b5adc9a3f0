"""The calculator interaction of the tools example: the model may call `calculator` (any number of times,
up to rollout.multi_turn.max_turns turns); the final turn is scored like the SmolLM2 example (the number
after '####', or with `lenient` the last number), plus a small bonus for a conversation whose calls all
worked (a format signal a 135M model can pick up before it gets answers right)."""

from shardrl.rewards.manager import gsm8k_flexible_score, gsm8k_score
from shardrl.rollout.episodes.multiturn import Interaction
from shardrl.tools import CalculatorTool

TOOL_BONUS = 0.1


class CalculatorInteraction(Interaction):
    tools = [CalculatorTool()]
    lenient = False

    def start(self, sample):
        extra = sample["extra"] or {}
        return {"truth": extra.get("ground_truth"), "calls": 0, "failed": 0}

    def step(self, state, call):
        state["calls"] += 1
        answer = super().step(state, call)
        state["failed"] += answer.startswith("error:")
        return answer

    def reward(self, state, response_text):
        score = (gsm8k_flexible_score if self.lenient else gsm8k_score)("gsm8k", response_text, state["truth"])
        return score + (TOOL_BONUS if state["calls"] and not state["failed"] else 0.0)


class LenientCalculatorInteraction(CalculatorInteraction):
    lenient = True
