"""Ascend NPU backend (torch_npu). The plugin is registered now; the backend comes in a later
release."""
