// The kvdepot release version, reported by Stats and /metrics (defined in
// common/version.h so kvcachectl reports the same).
#ifndef KVDEPOT_SERVER_VERSION_H_
#define KVDEPOT_SERVER_VERSION_H_

#include "common/version.h"

#endif  // KVDEPOT_SERVER_VERSION_H_
