"""A list-scheduling model of the fused backward's grid (bench/NOTES.md, version 96): how the order
of the dK/dV blocks and the turns of dQ's additions set the kernel's makespan.

Each block owns one key tile of a row (sequence, kv head) and walks the row's query tiles, one tile
step each: up from its diagonal, or down to it. After each step its writer adds the tile's part of
dQ, which takes `lam` steps and, in turns, waits until the key tiles before it in the query tile's
order have added theirs; the math runs at most two tiles ahead of the writer (two staging tiles).
Blocks start in grid order on `sms` slots as slots free up; a block ends when its writer has
added its last tile. Printed: the makespan over the ideal (all work spread evenly on the slots).

    python3 bench/backward_order_model.py            # D=128 and D=64, N = 2k-16k, the orders
    python3 bench/backward_order_model.py --d 64 --n 16384 --lam 1.0

Orders (sections as in block_tile_order, 8 MB of query tiles a section):
  last-first   every section's last key tiles first, walks up, turns from the diagonal down
               (deadlock-free: a block waits only for blocks started before it)
  first-first  the first key tiles first, walks up, the same turns (a block waits for blocks
               started after it)
  any-order    first-first without turns (FOX_NONDETERMINISTIC_BACKWARD=1)
  last-down    last-first, but the last section first-first with its walks going down and its
               turns from the first key tile up (deadlock-free; the default since version 96)
"""
import argparse
import collections
import heapq
import random


def makespan(blocks, num_query_tiles, ratio, lam, sms, turns=True, noise=0.05, seed=0):
    """blocks: (row, key tile, walks down) in grid order; ratio: query tiles per key tile."""
    rng = random.Random(seed)
    landed = collections.Counter()  # (row, query tile) -> additions landed
    waiting = collections.defaultdict(list)  # (row, query tile) -> blocks whose writer waits there
    events, seq = [], 0
    state = {}

    def push(t, kind, b):
        nonlocal seq
        heapq.heappush(events, (t, seq, kind, b))
        seq += 1

    def turn(b, q):
        _, kt, down = blocks[b]
        return kt if down else q // ratio - kt  # additions before this one at query tile q

    def step_time():
        return 1.0 + noise * rng.random()

    started, finished, end = 0, 0, 0.0
    for _ in range(min(sms, len(blocks))):
        push(0.0, "start", started)
        started += 1
    while events:
        t, _, kind, b = heapq.heappop(events)
        if kind == "start":
            _, kt, down = blocks[b]
            tiles = list(range(ratio * kt, num_query_tiles))
            state[b] = {"tiles": tiles[::-1] if down else tiles, "done": 0, "written": 0,
                        "writer_free": t, "math_waits": False}
            push(t + step_time(), "math", b)
        elif kind == "math":  # tile `done` computed and staged
            s = state[b]
            s["done"] += 1
            push(t, "write", b)
            if s["done"] < len(s["tiles"]):
                if s["done"] - s["written"] < 2:
                    push(t + step_time(), "math", b)
                else:
                    s["math_waits"] = True  # both staging tiles full
        elif kind == "write":
            s = state[b]
            n = s["written"]
            if n >= s["done"] or s["writer_free"] > t:
                continue
            key = (blocks[b][0], s["tiles"][n])
            if turns and landed[key] != turn(b, s["tiles"][n]):
                waiting[key].append(b)
                continue
            s["written"] += 1
            s["writer_free"] = t + lam
            if s["math_waits"]:  # a staging tile is free again
                s["math_waits"] = False
                push(t + step_time(), "math", b)
            push(t + lam, "landed", b)
        elif kind == "landed":
            s = state[b]
            key = (blocks[b][0], s["tiles"][s["written"] - 1])
            landed[key] += 1
            for w in waiting.pop(key, []):
                push(t, "write", w)
            if s["written"] == len(s["tiles"]):
                finished += 1
                end = max(end, t)
                if started < len(blocks):
                    push(t, "start", started)
                    started += 1
            else:
                push(t, "write", b)
    if finished < len(blocks):  # every block left waits for a turn of a block not started
        raise RuntimeError(f"deadlock: {len(blocks) - finished} of {len(blocks)} blocks never end")
    return end


def grid(rows, key_tiles, per_section, order):
    """The blocks of block_key_tile's order: sections of per_section rows, tiles rank-major."""
    out = []
    sections = list(range(0, rows, per_section))
    for i, first in enumerate(sections):
        section_rows = range(first, min(rows, first + per_section))
        down = order == "last-down" and i == len(sections) - 1
        first_first = order in ("first-first", "any-order") or down
        for rank in range(key_tiles):
            for row in section_rows:
                out.append((row, rank if first_first else key_tiles - 1 - rank, down))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--d", type=int, nargs="+", default=[128, 64])
    ap.add_argument("--n", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    ap.add_argument("--lam", type=float, default=0.65, help="an addition's time in tile steps")
    ap.add_argument("--sms", type=int, default=132)
    args = ap.parse_args()
    orders = ("last-first", "first-first", "any-order", "last-down")
    print("| D | N | rows | " + " | ".join(orders) + " |")
    print("|---" * (3 + len(orders)) + "|")
    for d in args.d:
        for n in args.n:
            rows = (16 if d == 128 else 32) * 16384 // n  # bench_cuda.py's shapes: B = 16384 / N
            query_tile = 64 if d == 128 else 128  # kDkdvQueries
            ratio, key_tiles = 128 // query_tile, n // 128
            per_section = max(1, min(rows, (8 << 20) // (4 * n * d)))
            ideal = rows * sum(n // query_tile - ratio * kt for kt in range(key_tiles)) / args.sms
            cells = []
            for o in orders:
                blocks = grid(rows, key_tiles, per_section, o)
                try:
                    span = makespan(blocks, n // query_tile, ratio, args.lam, args.sms, turns=o != "any-order")
                    cells.append(f"{span / ideal:.3f}")
                except RuntimeError:  # first-first in turns, where a section does not fit the slots
                    cells.append("deadlock")
            print(f"| {d} | {n} | {rows} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
