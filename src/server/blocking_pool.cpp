// blocking_pool.hpp is header-only; this unit keeps it compiled on its own.
#include "server/blocking_pool.hpp"
