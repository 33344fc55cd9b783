// The C++ object behind a torch.classes.torch_ext.* object handed over from Python.
#pragma once

#include <pybind11/pybind11.h>
#include <torch/csrc/jit/python/pybind_utils.h>

template <class T>
c10::intrusive_ptr<T> custom_class_of(const pybind11::handle& script_object) {
  static const auto type = c10::getCustomClassType<c10::intrusive_ptr<T>>();
  return torch::jit::toIValue(script_object, type).template toCustomClass<T>();
}
