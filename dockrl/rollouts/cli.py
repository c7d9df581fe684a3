"""``dockrl rollouts show | rescore | distill | replay | page``: a run's kept rollouts from the command line (docs/rollouts.md).

    dockrl rollouts show runs/demo --iteration 3
    dockrl rollouts rescore runs/demo --scorer mypkg.rewards:Strict
    dockrl rollouts distill runs/demo --teacher models/teacher
    dockrl rollouts replay runs/demo --iteration 3
    dockrl rollouts page runs/demo --out rollouts.html
"""

from __future__ import annotations

import argparse
import sys

from dockrl.rollouts.keep import kept_rollouts, show_table
from dockrl.rollouts.page import write_rollouts_page
from dockrl.rollouts.replay import replay_command
from dockrl.rollouts.rescore import rescore_command
from dockrl.rollouts.teacher import teacher_kl_command


def main(argv: list[str]) -> int:
    """``dockrl rollouts show | rescore | distill | replay | page RUN ...`` (RUN: a run folder or a pipeline's rollouts artifact):
    exit 0; 1 when ``replay`` differs from the logged values; 2 when RUN holds no kept rollouts or not what the
    command asks of it (one line on stderr: an iteration not kept, no checkpoint to replay from, a scorer that is no
    ``module:Class``)."""
    parser = argparse.ArgumentParser(prog="dockrl rollouts", description="A run's kept rollouts (run.keep_rollouts; docs/rollouts.md).")
    sub = parser.add_subparsers(dest="command", required=True)
    show = sub.add_parser("show", help="a table of one iteration's kept rows: reward, length, the response's first characters")
    show.add_argument("--iteration", type=int, required=True, help="the iteration to show")
    show.add_argument("--limit", type=int, default=20, help="rows shown at most (default 20)")
    show.add_argument("--width", type=int, default=60, help="characters of each response shown (default 60)")
    rescore = sub.add_parser("rescore", help="a new reward over the kept rows, beside the one the run trained with")
    rescore.add_argument("--scorer", default="", help="the new reward: module:Class (as algorithm.scorer)")
    rescore.add_argument("--judge", action="append", default=[], metavar="reward_model.FIELD=VALUE",
                         help="instead of --scorer: a generative judge's setting (repeatable): reward_model.model.path, "
                              "reward_model.generative.template, .parser, ... (reward_model.kind=generative implied)")
    rescore.add_argument("--iteration", type=int, default=None, help="only this iteration (default: all)")
    rescore.add_argument("--out", default=None, help="also write the table (iteration, row, old, new, new_bad) as Parquet here")
    distill = sub.add_parser("distill", help="a teacher's per-token reverse KL to the policy over the kept rows")
    distill.add_argument("--teacher", required=True, help="the teacher: a local HF causal LM folder with the run's tokenizer")
    distill.add_argument("--iteration", type=int, default=None, help="only this iteration (default: all)")
    distill.add_argument("--out", default=None, help="also write the table (iteration, row, tokens, reverse_kl) as Parquet here")
    replay = sub.add_parser("replay", help="recompute an iteration's actor loss and gradient norm from its kept rows and checkpoint")
    replay.add_argument("--iteration", type=int, required=True, help="the iteration to replay")
    page = sub.add_parser("page", help="an HTML page of the kept rollouts: rewards, lengths, best and worst responses")
    page.add_argument("--out", required=True, help="the HTML file to write")
    for command in (show, rescore, distill, replay, page):
        command.add_argument("run", help="run folder (run.output_dir), or a pipeline's rollouts artifact folder")
    args = parser.parse_args(argv)
    try:
        kept = kept_rollouts(args.run)
        if args.command == "show":
            print(show_table(kept, args.iteration, args.limit, args.width))
        elif args.command == "rescore":
            print(rescore_command(kept, args.scorer, args.iteration, args.out, judge=args.judge))
        elif args.command == "distill":
            print(teacher_kl_command(kept, args.teacher, args.iteration, args.out))
        elif args.command == "replay":
            text, same = replay_command(kept, args.iteration)
            print(text)
            return 0 if same else 1
        else:
            print(write_rollouts_page(kept, args.out))
    except (ValueError, KeyError, FileNotFoundError) as e:  # what the user asked for is not in RUN: one line, no traceback
        text = str(e.args[0] if isinstance(e, KeyError) and e.args else e)  # a KeyError's str() is its repr
        print(text if text.startswith("dockrl ") else f"dockrl rollouts {args.command}: {text}", file=sys.stderr)
        return 2
    return 0
