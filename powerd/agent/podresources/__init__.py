"""The kubelet's PodResources API, v1: `api.proto` as published by Kubernetes
(k8s.io/kubelet/pkg/apis/podresources/v1/api.proto, Apache-2.0, LICENSE beside it; taken
unchanged from kubernetes/kubelet at 63b3249724f7d89a8aa48f9acb3811f193c9aa68), and the
Python module protoc generates from it (`api_pb2.py`, `api_pb2.pyi`; never edited by hand).

Regenerate after changing the proto or the pinned grpcio-tools (protobuf's runtime must be
at least the version the module names; tests/test_kubelet.py checks the two agree):

    python -m grpc_tools.protoc -I . --python_out=. --pyi_out=. \\
        powerd/agent/podresources/api.proto

Only `powerd.agent.kubelet` imports it, and only when jobs from Kubernetes are configured:
grpcio and protobuf are the `kubernetes` extra's.
"""
