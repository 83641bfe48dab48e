"""What `centerline up` shows as it runs (centerline/up/console.py): on a terminal, a held-out record
is one line naming its figure, the accuracy or the mean reward."""

import io

from centerline.up.console import Progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_heldout_record_on_a_terminal_is_one_line_naming_its_figure():
    out = Terminal()
    Progress(out).show({"step": 4, "heldout_accuracy": 0.5, "heldout_rows": 8}, steps=10)
    Progress(out).show({"step": 6, "heldout_reward": 0.25, "heldout_rows": 3}, steps=10)
    assert out.getvalue() == (
        "\r\x1b[K  held-out accuracy at step 4: 0.500\n\r\x1b[K  held-out mean reward at step 6: 0.250\n"
    )


def test_a_heldout_record_elsewhere_is_its_json_line():
    out = io.StringIO()
    Progress(out).show({"step": 4, "heldout_accuracy": 0.5}, steps=10)
    assert out.getvalue() == '{"step":4,"heldout_accuracy":0.5}\n'
