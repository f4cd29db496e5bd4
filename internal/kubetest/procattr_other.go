//go:build !linux

package kubetest

import "syscall"

// sysProcAttr: no parent-death signal outside Linux; Stop and t.Cleanup end the children.
func sysProcAttr() *syscall.SysProcAttr { return nil }
