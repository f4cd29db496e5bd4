package kubetest

import "syscall"

// sysProcAttr kills the child when the test process dies without running
// its cleanups (a panic, a SIGKILL from go test's -timeout): no etcd or
// kube-apiserver outlives the test binary.
func sysProcAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
