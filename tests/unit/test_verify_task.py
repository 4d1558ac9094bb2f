"""``verify:<task>``: a verifier's task built from another task's questions and a fixed
solver's proposed answers (``seamlessflow.tasks.verify``), and a policy's own held-out
task in a run (``RunConfig.eval_tasks``)."""

from __future__ import annotations

import re

import pytest
from pydantic import ValidationError

from seamlessflow.assets.pretrained import SMOLLM2_TASK
from seamlessflow.plugins import UnknownPlugin
from seamlessflow.rewards import first_integer, get_reward
from seamlessflow.tasks import get_task_source
from seamlessflow.tasks.verify import VERIFIER_SYSTEM_PROMPT, reference_answer
from sf_app.run.config import RunConfig

PROPOSED = re.compile(r'\nSomeone replied: "The answer is (-?\d+)\."\nIs that reply right\?$')


@pytest.mark.parametrize("inner_name", ["arithmetic", SMOLLM2_TASK])
def test_each_split_is_half_right_half_near_misses_judged_by_the_inner_tasks_own_reward(
    inner_name: str,
) -> None:
    inner = get_task_source(inner_name, seed=3)
    verify = get_task_source(f"verify:{inner_name}", seed=3)
    assert verify.name == f"verify:{inner.name}" and verify.reward_fn == "verdict_match"
    judge = get_reward(inner.reward_fn)
    for split in ("train", "eval"):
        inner_items = {item.task_id: item for item in inner.items(split)}
        items = verify.items(split)
        verdicts = [item.reference for item in items]
        assert set(verdicts) == {"yes", "no"}
        # balanced: a verifier that always answers the same scores one half
        assert abs(verdicts.count("yes") - verdicts.count("no")) <= len(items) * 0.1
        for item in items:
            source = inner_items[item.task_id.split("/", 1)[1]]
            system, message = item.messages
            assert system == {"role": "system", "content": VERIFIER_SYSTEM_PROMPT}
            question = "\n".join(m["content"] for m in source.messages if m["role"] == "user")
            assert message["role"] == "user"
            assert message["content"].startswith(f"Question: {question}\n")
            match = PROPOSED.search(message["content"])
            assert match, message["content"]
            proposed = int(match.group(1))
            answer = first_integer(reference_answer(source.reference))
            assert answer is not None
            # the verdict is the inner task's scorer on the proposed answer
            verdict = judge(f"The answer is {proposed}.", source.reference)
            assert item.reference == ("yes" if verdict == 1.0 else "no")
            if item.task_id.startswith("verify-wrong/") and proposed != answer:
                assert 1 <= abs(proposed - answer) <= 5
    # disjoint splits, deterministic for the seed, another seed another draw
    train = {i.task_id.split("/", 1)[1] for i in verify.items("train")}
    assert not train & {i.task_id.split("/", 1)[1] for i in verify.items("eval")}
    assert verify.items("eval") == get_task_source(f"verify:{inner_name}", seed=3).items("eval")
    assert verify.items("eval") != get_task_source(f"verify:{inner_name}", seed=4).items("eval")


def test_a_reply_is_scored_by_its_first_yes_or_no_against_the_verdict() -> None:
    items = get_task_source("verify:arithmetic", seed=0).items("eval")
    reward = get_reward("verdict_match")
    always_yes = sum(reward("Yes.", item.reference) for item in items) / len(items)
    right = sum(reward(f"{item.reference.title()}, it is", item.reference) for item in items)
    assert always_yes == pytest.approx(0.5) and right == len(items)
    # the first whole word decides; a reply without one scores 0 against either verdict
    assert reward("No, the answer is 7. Yes, 7.", "no") == 1.0
    assert reward("YES", "yes") == 1.0 and reward("yes", "no") == 0.0
    for no_verdict in ["Nobody knows", "my eyes", "The answer is 7.", ""]:
        assert reward(no_verdict, "yes") == reward(no_verdict, "no") == 0.0


def test_a_task_without_integer_answers_or_an_unknown_one_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="'verify:lookup': 'lookup' has no train item"):
        get_task_source("verify:lookup").items("train")
    with pytest.raises(UnknownPlugin, match="no-such-task"):
        get_task_source("verify:no-such-task")


def test_a_policy_can_be_evaluated_on_its_own_task() -> None:
    config = RunConfig(policies=["solver", "verifier"], eval_tasks=["verifier=verify:arithmetic"])
    assert config.eval_task_of() == {"verifier": "verify:arithmetic"}
    assert RunConfig().eval_task_of() == {}
    for entries, error in [
        (["verify:arithmetic"], "is not POLICY=TASK"),
        (["judge=verify:arithmetic"], "'judge' is not a policy of the run"),
        (["verifier=a", "verifier=b"], "'verifier' is given twice"),
        (["verifier="], "is not POLICY=TASK"),
    ]:
        with pytest.raises(ValidationError, match=error):
            RunConfig(policies=["solver", "verifier"], eval_tasks=entries)
