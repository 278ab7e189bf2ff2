"""`opweave bench`: opweave against eager PyTorch, TorchInductor, ONNX Runtime, TVM and
OpenVINO.

`harness` runs the measurements (each backend in its own worker process, interleaved),
`backends` prepares each backend inside its worker, `roofline` gives FLOPs and the GEMM
peak, `report` writes the terminal table, JSON, markdown and PNG. Importing this package
does not import torch.
"""
