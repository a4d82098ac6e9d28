// Handler symbols defined in cpu_ops.cc, exported to Python as capsules.
#ifndef TPUSYNC_XLA_CPU_OPS_H_
#define TPUSYNC_XLA_CPU_OPS_H_

#include "xla/ffi/api/c_api.h"

namespace tpusync {
extern "C" {
XLA_FFI_Error* TpusyncStartCpu(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* TpusyncWaitCpu(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* TpusyncWriteBackCpu(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* TpusyncMarkCpu(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* TpusyncAttendCpu(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* TpusyncAttendLandedCpu(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* TpusyncAttendSpilledCpu(XLA_FFI_CallFrame* call_frame);
}
}  // namespace tpusync

#endif  // TPUSYNC_XLA_CPU_OPS_H_
