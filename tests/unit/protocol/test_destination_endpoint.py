"""The endpoint-picker protocol's answer (extproc.protocol.messages.with_destination): the picked
endpoints in `x-gateway-destination-endpoint`, overwriting any copy, and under the same key in the
`envoy.lb` dynamic metadata; nothing without a pick."""

from __future__ import annotations

from envoy.config.core.v3.base_pb2 import HeaderValueOption

from extproc.protocol import messages as msg


def test_the_pick_goes_in_the_header_and_the_lb_metadata():
    answer = msg.with_destination(msg.route_to_cluster("x-iris-cluster", "pool", {"x-iris-affinity": "k"}),
                                  ("10.0.0.5:8000", "10.0.0.6:8000"))
    options = {o.header.key: o for o in answer.request_body.response.header_mutation.set_headers}
    option = options[msg.DESTINATION_ENDPOINT_HEADER]
    assert option.header.raw_value == b"10.0.0.5:8000,10.0.0.6:8000"
    assert option.append_action == HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
    lb = answer.dynamic_metadata.fields[msg.LB_METADATA_NAMESPACE].struct_value.fields
    assert lb[msg.DESTINATION_ENDPOINT_HEADER].string_value == "10.0.0.5:8000,10.0.0.6:8000"


def test_no_pick_leaves_the_answer_alone():
    answer = msg.route_to_cluster("x-iris-cluster", "pool")
    assert msg.with_destination(answer, ()) is answer
    assert msg.LB_METADATA_NAMESPACE not in answer.dynamic_metadata.fields
    assert all(o.header.key != msg.DESTINATION_ENDPOINT_HEADER for o in answer.request_body.response.header_mutation.set_headers)
