// The Python module linnet._C. Loading it registers Linnet's ops with the
// dispatcher (the static initialisers of the other files in csrc/); the module
// itself binds what crosses into Python at setup time, the flat layout, and
// the count of the casts that Adam's steps keep (csrc/stepped_casts.cpp).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <sstream>

#include "flat_layout.h"
#include "ops.h"

namespace py = pybind11;

PYBIND11_MODULE(_C, m) {
  m.doc() = "Linnet's C++: importing it registers torch.ops.linnet.*; it also binds the flat layout.";

  // Read-only: a layout is computed once, by flat_layout, and then shared by
  // every part of a group, so no holder may change it under the others.
  py::class_<linnet::FlatLayout>(
      m,
      "FlatLayout",
      "Where each tensor of a group lies in the group's flat buffer, and the parts "
      "that buffer splits into; made by flat_layout.")
      .def_property_readonly(
          "offsets",
          [](const linnet::FlatLayout& layout) { return py::tuple(py::cast(layout.offsets)); },
          "where each tensor starts in the flat buffer, in elements (a tuple)")
      .def_readonly("total", &linnet::FlatLayout::total, "padded length of the buffer: world * part_size")
      .def_readonly("part_size", &linnet::FlatLayout::part_size, "one rank's part, a multiple of align")
      .def("__repr__", [](const linnet::FlatLayout& layout) {
        std::ostringstream text;
        text << "FlatLayout(offsets=(";
        for (size_t i = 0; i < layout.offsets.size(); ++i) {
          text << (i ? ", " : "") << layout.offsets[i];
        }
        text << (layout.offsets.size() == 1 ? ",)" : ")") << ", total=" << layout.total
             << ", part_size=" << layout.part_size << ")";
        return text.str();
      });

  // std::invalid_argument, flat_layout's error for bad arguments, reaches
  // Python as ValueError (pybind11's translation).
  m.def(
      "flat_layout",
      &linnet::flat_layout,
      py::arg("numels"),
      py::arg("align"),
      py::arg("world"),
      "Lays out tensors of `numels` elements one after another, each starting at a "
      "multiple of `align` elements, padded to split into `world` equal parts.");

  m.def(
      "stepped_casts_kept",
      &linnet::stepped_casts_kept,
      "How many casts of stepped parts are kept for the next cast of their part (adam_step_'s copy_dtype).");
  m.def(
      "drop_stepped_casts",
      &linnet::drop_stepped_casts,
      py::arg("parts"),
      "Drops the kept casts of `parts` (a list of tensors): the next cast of each casts it.");
}
