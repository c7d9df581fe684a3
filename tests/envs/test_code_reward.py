"""The code-execution reward (dockrl.rewards.code) and the bundled tasks (dockrl.envs.tasks)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from dockrl.config import Config
from dockrl.config.algorithm_sections import AlgorithmConfig
from dockrl.envs.tasks import CODE_PROBLEMS, TOOL_SEEDS, generate_tool_problems, load_code_problems
from dockrl.rewards.code import CodeScorer, extract_program, reference_solutions
from dockrl.rewards.guard import build_scorer, check_rewards
from dockrl.run.data import load_prompts


@pytest.fixture(scope="module")
def scorer():
    s = CodeScorer(timeout_s=3.0)
    yield s
    s.close()


def test_the_reference_solutions_pass_every_test(scorer):
    references = reference_solutions()
    assert len(references) == 10 and all(len(t) == 3 for t in load_code_problems().values())
    assert scorer.score(list(references.values()), list(references)) == [1.0] * 10


def test_a_problems_file_saved_with_a_utf8_bom_keeps_its_first_problem(tmp_path):
    path = tmp_path / "problems.jsonl"
    path.write_text(CODE_PROBLEMS.read_text(encoding="utf-8"), encoding="utf-8-sig")
    assert load_code_problems(path) == load_code_problems() and reference_solutions(path) == reference_solutions()


def test_the_reward_is_the_pass_rate(scorer):
    responses = [
        "```python\ndef gcd(a, b):\n    return 1\n```",  # passes gcd(7, 13) == 1 only
        "```python\ndef is_prime(n):\n    return n in (2, 3, 5, 7, 97)\n```",  # fails the range test only
        "I think gcd is easy.",  # no program
        "```python\ndef gcd(a, b):\n    while True:\n        pass\n```",  # hangs on the first test
        "```python\nprint('3f2a 0 pass')\ndef add_digits(n):\n    raise ValueError\n```",  # a forged result line does not count
        "```python\nimport sys\nsys.exit(0)\n```",  # exits before the tests: none passed
        "```python\nx = 1\n```\nthen the fixed one\n```python\ndef count_vowels(s):\n    return sum(c in 'aeiouAEIOU' for c in s)\n```",
    ]
    before = scorer.counters()
    rewards = scorer.score(responses, ["6", "9", "6", "6", "1", "1", "4"])
    assert rewards == pytest.approx([1 / 3, 2 / 3, 0.0, 0.0, 0.0, 0.0, 1.0])
    after = scorer.counters()
    assert after["scored"] - before["scored"] == 7 and after["errors"] - before["errors"] == 1
    assert after["timeouts"] - before["timeouts"] == 1 and after["tests_passed"] - before["tests_passed"] == 1 + 2 + 3


def test_format_reward_is_added_for_a_program():
    s = CodeScorer(timeout_s=3.0, correct_reward=1.0, format_reward=0.1)
    assert s.score(["```python\ndef gcd(a, b):\n    return 0\n```", "no code"], ["6", "6"]) == pytest.approx([0.1, 0.0])


def test_an_unknown_task_id_is_an_error_naming_it(scorer):
    with pytest.raises(ValueError, match=r"ground truths \['99'\] are no task_id"):
        scorer.score(["```python\npass\n```"], ["99"])


def test_extract_program_takes_the_last_python_block():
    assert extract_program("```python\na = 1\n```\n```python\nb = 2\n```") == "b = 2\n"
    assert extract_program("no block") is None


def test_code_scorer_as_algorithm_scorer_runs_in_its_own_process():
    a = AlgorithmConfig(scorer="dockrl.rewards.code:CodeScorer", reward_timeout_s=3.0)
    scorer = build_scorer(a)
    try:
        references = reference_solutions()
        result = scorer.score(list(references.values())[:3], list(references)[:3])
        rewards, bad = check_rewards(result, 3)
        assert rewards == pytest.approx([1.0 + a.format_reward] * 3) and not bad
        assert scorer.counters()["tests_passed"] == 9
    finally:
        scorer.close()


def test_bundled_files_load_with_the_data_loader(tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    for path in (CODE_PROBLEMS, *TOOL_SEEDS):
        prompts, report = load_prompts(path, tokenizer, system_prompt="", max_prompt_length=512, chat_template="none")
        assert not report.bad and len(prompts) == sum(1 for line in path.read_text().splitlines() if line.strip())
    code, _ = load_prompts(CODE_PROBLEMS, tokenizer, system_prompt="", max_prompt_length=512, chat_template="none")
    assert [p.ground_truth for p in code] == [str(i) for i in range(1, 11)]


def test_bundled_tool_files_are_the_generator_output():
    for path, (count, seed) in TOOL_SEEDS.items():
        assert [json.loads(line) for line in path.read_text().splitlines()] == generate_tool_problems(count, seed=seed)


def test_tool_problems_are_right_and_seeded():
    problems = generate_tool_problems(50, seed=3)
    assert problems == generate_tool_problems(50, seed=3) != generate_tool_problems(50, seed=4)
    for p in problems:
        work, value = p["answer"].split("\n")[0].split(" = ")
        assert str(eval(work)) == value == p["answer"].rsplit("#### ", 1)[1]  # the test's own check of the generator's arithmetic
    with pytest.raises(ValueError, match="min_digits"):
        generate_tool_problems(1, seed=0, min_digits=0)


def test_config_with_the_code_scorer_is_valid():
    c = dataclasses.replace(Config(), algorithm=AlgorithmConfig(scorer="dockrl.rewards.code:CodeScorer"))
    assert c.algorithm.scorer.endswith("CodeScorer")
