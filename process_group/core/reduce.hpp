// Internal: the three-operand reduction kernel behind reduceInto, used by the collective
// algorithms so that a reduction never needs a separate copy (reduce-scatter writes
// `in op received` straight into its output).
#pragma once

#include <cstddef>

#include "process_group/core/datatype.hpp"

namespace zeroplus::pg::detail {

// dst[i] = a[i] (op) b[i] for i < count. dst may alias a or b exactly (element-wise in place);
// partial overlap is not allowed. Operand order is part of the contract: floating-point results
// depend on it only for NaN payloads, but callers keep it fixed so every rank computes the
// same bits. Precondition: reduceSupported(type, op).
void reduceTo(void* dst, const void* a, const void* b, size_t count, DataType type, ReduceOp op);

}  // namespace zeroplus::pg::detail
