"""GridMaze: walk through a small text grid to the goal, seeing only your surroundings.

This module knows text only.
"""

from __future__ import annotations

from collections import deque

from prefixgym.envs.base import AgentEnv, Outcome

MOVES: dict[str, tuple[int, int]] = {"up": (-1, 0), "down": (1, 0), "left": (0, -1),
                                     "right": (0, 1)}
Cell = tuple[int, int]


class GridMaze(AgentEnv):
    """Reach the goal in a `size` x `size` grid with random walls.

    Rules: each reply is one move: "up", "down", "left" or "right". The env answers
    with the 3x3 view around the agent ("A" agent, "#" wall or edge, "." open,
    "G" goal) and the goal's offset, e.g. "Goal: 2 down, 1 right." A move into a
    wall is "Blocked." (no move, no penalty); any other reply is invalid.

    Reward: 1.0 for reaching the goal (ends the episode); partial credit for getting
    closer: each move earns `progress_credit * (d_before - d_after) / d_start`, where
    d is the shortest-path distance to the goal (moving away costs the same);
    `-invalid_penalty` per invalid reply. The expert follows a shortest path.
    Difficulty: `size` (3..12), `wall_density` (0..0.4), `max_turns` (default 4*size).
    """

    system_prompt = (
        "You are in a maze. Reach the goal G. Reply with one move: up, down, left or right."
    )

    def __init__(
        self,
        *,
        size: int = 5,
        wall_density: float = 0.25,
        max_turns: int | None = None,
        progress_credit: float = 0.5,
        invalid_penalty: float = 0.1,
        render_mode: str | None = None,
    ) -> None:
        if not 3 <= size <= 12:
            raise ValueError(f"size must be in 3..12, got {size!r}")
        if not 0.0 <= wall_density <= 0.4:
            raise ValueError(f"wall_density must be in 0..0.4, got {wall_density!r}")
        super().__init__(max_turns=4 * size if max_turns is None else max_turns,
                         invalid_penalty=invalid_penalty, render_mode=render_mode)
        self.size, self.wall_density = size, wall_density
        self.progress_credit = float(progress_credit)
        self._walls: set[Cell] = set()
        self._pos: Cell = (0, 0)
        self._goal: Cell = (0, 0)
        self._dist: dict[Cell, int] = {}
        self._start_dist = 1

    def _reset_task(self) -> str:
        rng = self.np_random
        cells = [(r, c) for r in range(self.size) for c in range(self.size)]
        while True:  # draw until the goal is reachable and not next to the start
            walls = {cell for cell in cells if rng.random() < self.wall_density}
            free = [cell for cell in cells if cell not in walls]
            if len(free) < 2:
                continue
            start, goal = (free[int(i)] for i in rng.choice(len(free), size=2, replace=False))
            self._walls, self._goal = walls, goal
            self._dist = self._distances_to_goal()
            if self._dist.get(start, 0) >= 2:
                break
        self._pos, self._start_dist = start, self._dist[start]
        return f"Find the goal.\n{self._view()}"

    def _act(self, text: str) -> Outcome:
        move = text.strip().lower().rstrip(".")
        if move not in MOVES:
            return Outcome(f"Invalid. Reply with up, down, left or right.\n{self._view()}",
                           invalid=True)
        dr, dc = MOVES[move]
        target = (self._pos[0] + dr, self._pos[1] + dc)
        if target not in self._dist:  # a wall or the edge: open neighbours reach the goal
            return Outcome(f"Blocked.\n{self._view()}")
        before, after = self._dist[self._pos], self._dist[target]
        self._pos = target
        progress = self.progress_credit * (before - after) / self._start_dist
        rewards = {"progress": progress}
        if target == self._goal:
            return Outcome("You reached the goal!", rewards={**rewards, "success": 1.0},
                           done=True, success=True)
        return Outcome(self._view(), rewards=rewards)

    def expert_action(self) -> str:
        here = self._dist[self._pos]
        for name, (dr, dc) in MOVES.items():
            if self._dist.get((self._pos[0] + dr, self._pos[1] + dc)) == here - 1:
                return name
        return "up"  # only at the goal, where the episode is already over

    def _is_open(self, cell: Cell) -> bool:
        r, c = cell
        return 0 <= r < self.size and 0 <= c < self.size and cell not in self._walls

    def _distances_to_goal(self) -> dict[Cell, int]:
        dist = {self._goal: 0}
        queue = deque([self._goal])
        while queue:
            cell = queue.popleft()
            for dr, dc in MOVES.values():
                nxt = (cell[0] + dr, cell[1] + dc)
                if self._is_open(nxt) and nxt not in dist:
                    dist[nxt] = dist[cell] + 1
                    queue.append(nxt)
        return dist

    def _view(self) -> str:
        rows = []
        for dr in (-1, 0, 1):
            row = ""
            for dc in (-1, 0, 1):
                cell = (self._pos[0] + dr, self._pos[1] + dc)
                row += ("A" if cell == self._pos else "G" if cell == self._goal
                        else "." if self._is_open(cell) else "#")
            rows.append(row)
        gr, gc = self._goal[0] - self._pos[0], self._goal[1] - self._pos[1]
        parts = [f"{abs(gr)} {'down' if gr > 0 else 'up'}"] if gr else []
        parts += [f"{abs(gc)} {'right' if gc > 0 else 'left'}"] if gc else []
        return "\n".join(rows) + f"\nGoal: {', '.join(parts)}."
