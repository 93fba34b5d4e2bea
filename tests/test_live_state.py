"""A live stream whose saved selector state comes from another release goes on with a fresh selector and keeps
its numbering (a state-version change must not fail every later frame of the stream)."""

from __future__ import annotations

from specstream.pipeline.broker import InProcessBroker
from specstream.stages.keyframes.selector import KeyframeSelector
from specstream.pipeline.live import LiveKeyframeStage


class DictStore(dict):
    async def put(self, key, value):
        self[key] = value


def test_old_state_version_starts_a_fresh_selector_keeping_the_numbering():
    current = KeyframeSelector().state_dict()
    old = dict(current, detector=dict(current["detector"], version=-1))
    store = DictStore({"live/cam1": {"selector": old, "next_seq": 7, "next_frame_index": 120, "next_offset": 41}})
    stage = LiveKeyframeStage(InProcessBroker(), store=store)
    st = stage._stream("cam1", 0)
    assert (st.next_seq, st.next_frame_index, st.next_offset) == (7, 120, 41)
    assert st.selector.state_dict()["detector"]["version"] == current["detector"]["version"]
    good = DictStore({"live/cam2": {"selector": current, "next_seq": 3, "next_frame_index": 9, "next_offset": 5}})
    assert LiveKeyframeStage(InProcessBroker(), store=good)._stream("cam2", 0).next_seq == 3
