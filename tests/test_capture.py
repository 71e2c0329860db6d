"""The rank's output queue (engine/capture.py): what the control thread
sends, and the unfinished line a read asks with as its prompt, whether or not
part of it went out already."""

from __future__ import annotations

from monarch_nb.engine.capture import OutputBuffer


def test_the_prompt_is_the_unfinished_line_not_yet_sent() -> None:
    out = OutputBuffer()
    out.begin(7)
    out.write("stdout", "listing\n(Pdb) ")
    assert out.take_partial() == "(Pdb) "
    assert out.take_chunk() == (7, 0, [["stdout", "listing\n"]])


def test_a_prompt_that_went_out_as_output_is_still_the_prompt() -> None:
    out = OutputBuffer()
    out.begin(7)
    out.write("stdout", "listing\ncol")
    assert out.take_chunk() == (7, 0, [["stdout", "listing\ncol"]])  # the control thread
    out.write("stdout", "our? ")
    assert out.take_partial() == "colour? "
    assert out.take_partial() == ""  # taken once
    out.write("stdout", "name? ")
    out.take_chunk()
    assert out.take_partial() == "name? "  # all of it went out
    assert out.pending == 0


def test_a_line_that_began_after_an_unsent_newline_has_no_sent_tail() -> None:
    out = OutputBuffer()
    out.begin(7)
    out.write("stdout", "abc")
    out.take_chunk()
    out.write("stdout", "def\nnew? ")
    assert out.take_partial() == "new? "
    out.write("stdout", "x")
    out.take_chunk()
    out.write("stdout", "y\n")
    out.write("stderr", "warn\n")
    out.write("stdout", "q? ")
    assert out.take_partial() == "q? "


def test_a_new_call_forgets_the_last_ones_tail() -> None:
    out = OutputBuffer()
    out.begin(1)
    out.write("stdout", "half")
    out.take_chunk()
    out.finish()
    out.begin(2)
    out.write("stdout", "ask? ")
    assert out.take_partial() == "ask? "
    out.take_chunk()
    out.begin(3)
    assert out.take_partial() == ""
