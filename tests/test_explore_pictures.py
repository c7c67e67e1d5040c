"""Sweep pictures: the Pareto front is exactly the undominated points; files are byte-identical across renders."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from simulator.explore.pictures import heatmap_figure, pareto_figure, pareto_front, render

_values = st.lists(st.tuples(st.integers(0, 20), st.integers(0, 20)), min_size=1, max_size=40)


def _beats(a, b, maximize_y) -> bool:
    """a is at least as good as b on both axes and better on one."""
    (ax, ay), (bx, by) = a, b
    if maximize_y:
        ay, by = -ay, -by
    return ax <= bx and ay <= by and (ax, ay) != (bx, by)


@given(_values, st.booleans())
def test_the_front_is_the_undominated_points(points, maximize_y):
    xs, ys = [float(x) for x, _ in points], [float(y) for _, y in points]
    front = pareto_front(xs, ys, maximize_y=maximize_y)
    assert front == sorted(front, key=lambda k: (xs[k], -ys[k] if maximize_y else ys[k], k))
    for k in range(len(points)):
        dominated = any(_beats(points[j], points[k], maximize_y) for j in range(len(points)))
        duplicate_earlier = any(points[j] == points[k] for j in range(k))
        assert (k in front) == (not dominated and not duplicate_earlier), (k, points)


def test_renders_are_byte_identical_and_undated():
    def draw():
        pareto = pareto_figure([1.0, 2.0, 3.0], [3.0, 1.0, 2.0], ["a", "b", "c"], x_label="x", y_label="y",
                               title="t")
        heat = heatmap_figure({(1, 1): 0.5, (2, 1): None, (1, 2): 0.7}, "heat")
        return render(pareto) + render(heat)

    first, second = draw(), draw()
    assert first == second
    png, svg = first[0], first[1].decode("utf-8")
    assert png.startswith(b"\x89PNG") and b"Software" not in png
    assert "<dc:date>" not in svg and "Matplotlib v" not in svg
    # the cell whose plans do not fit is hatched (an SVG pattern); the Pareto figure has none
    assert "<pattern" in first[3].decode("utf-8") and "<pattern" not in svg
