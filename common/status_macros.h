// Early returns for absl::Status and absl::StatusOr, the one copy in the tree:
//
//   RETURN_IF_ERROR(ValidateFormat(f));
//   ASSIGN_OR_RETURN(PoolLayout layout, MakePoolLayout(f, bs, nb, nl));
//   ASSIGN_OR_RETURN(auto plan, builder.Finish());
//
// RETURN_IF_ERROR takes any expression yielding absl::Status; the enclosing
// function returns absl::Status or an absl::StatusOr<T>. ASSIGN_OR_RETURN
// evaluates its second argument once; on error it returns the status, else
// it moves the value into the declaration or lvalue given first. Neither
// macro may be used in a braceless if/else (each expands to statements).
#ifndef KVDEPOT_COMMON_STATUS_MACROS_H_
#define KVDEPOT_COMMON_STATUS_MACROS_H_

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define KVDEPOT_STATUS_CONCAT_INNER_(a, b) a##b
#define KVDEPOT_STATUS_CONCAT_(a, b) KVDEPOT_STATUS_CONCAT_INNER_(a, b)

#define RETURN_IF_ERROR(expr)                                             \
  do {                                                                    \
    if (::absl::Status kvdepot_status_ = (expr); !kvdepot_status_.ok()) { \
      return kvdepot_status_;                                             \
    }                                                                     \
  } while (false)

#define ASSIGN_OR_RETURN(lhs, rexpr) \
  KVDEPOT_ASSIGN_OR_RETURN_IMPL_(    \
      KVDEPOT_STATUS_CONCAT_(kvdepot_statusor_, __LINE__), lhs, rexpr)

#define KVDEPOT_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, rexpr) \
  auto statusor = (rexpr);                                   \
  if (!statusor.ok()) return std::move(statusor).status();   \
  lhs = *std::move(statusor)

#endif  // KVDEPOT_COMMON_STATUS_MACROS_H_
