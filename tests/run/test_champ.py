import json

from dockrl.run.data import export_champ, final_answer_of


def test_champ_exports_numeric_problems_in_gsm8k_format(tmp_path):
    rows = [json.loads(x) for x in export_champ(tmp_path / "champ.jsonl").read_text().splitlines()]
    assert 50 <= len(rows) < 270  # numeric answers only
    for row in rows:
        assert row["question"].strip()
        truth = final_answer_of(row["answer"])
        assert truth is not None and any(ch.isdigit() for ch in truth)
