"""What the Python examples share: finding or building their snapshot and
checking their own results."""

import os
import sys
import time

from forkd import Controller, NotFoundError


def snapshot(c: Controller, tag: str, image: str) -> str:
    """The tag to fork from: $EXAMPLE_SNAPSHOT if set (it must exist), else
    ``tag``, built from ``image`` when it is not there yet."""
    want = os.environ.get("EXAMPLE_SNAPSHOT", "")
    if want:
        c.get_snapshot(want)  # NotFoundError names it
        return want
    try:
        s = c.get_snapshot(tag)
        if s.status == "ready":
            return tag
        # Being written by someone else: wait for it.
        while s.status == "writing":
            time.sleep(1)
            s = c.get_snapshot(tag)
        if s.status == "ready":
            return tag
        fail(f"snapshot {tag} is {s.status}: remove it (forkd rmi {tag}) or set EXAMPLE_SNAPSHOT")
    except NotFoundError:
        pass
    say(f"building snapshot {tag} from image {image} (once; later runs reuse it)")
    c.create_snapshot(tag, image, progress=lambda line: say("  " + line))
    return tag


def say(msg: str) -> None:
    print(msg, flush=True)


def fail(msg: str) -> None:
    print("FAIL: " + msg, file=sys.stderr, flush=True)
    sys.exit(1)


def check(ok: bool, msg: str) -> None:
    """Fails the example unless ok."""
    if not ok:
        fail(msg)
