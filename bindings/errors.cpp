// Turns zcore::Error into the Python exception class of its StatusCode
// (defined in zcore/errors.py), with the error's details as keyword
// arguments so they become attributes.
#include <pybind11/stl.h>

#include "bindings.h"
#include "zcore/status.h"

namespace py = pybind11;

namespace zcore::bindings {

void bind_errors(py::module_& m) {
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const Error& e) {
      py::object cls =
          py::module_::import("zcore.errors").attr("exception_for")(status_code_name(e.code()));
      py::dict kwargs;
      for (const auto& [key, value] : e.details()) kwargs[py::str(key)] = py::cast(value);
      py::object exc = cls(e.what(), **kwargs);
      PyErr_SetObject(cls.ptr(), exc.ptr());
    }
  });
  (void)m;
}

}  // namespace zcore::bindings
