//go:build !linux

package childproc

import "syscall"

// Attr returns nil outside Linux: there is no parent-death signal, and the
// tests' cleanups end the children.
func Attr() *syscall.SysProcAttr { return nil }
