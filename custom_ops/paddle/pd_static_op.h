// PD_BUILD_STATIC_OP: the registration macro the FastDeploy op sources use.  Paddle ships
// only PD_BUILD_OP; this project's ops register under FastDeploy's op names, so the
// macro is a thin alias that keeps the sources in FastDeploy's style.
#pragma once

#include "paddle/extension.h"

#ifndef PD_BUILD_STATIC_OP
#define PD_BUILD_STATIC_OP(op_name) PD_BUILD_OP(op_name)
#endif
