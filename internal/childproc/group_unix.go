//go:build unix && !linux

package childproc

import "syscall"

// Group gives the child a new process group (Setpgid), without the
// parent-death signal only Linux has.
func Group() *syscall.SysProcAttr { return &syscall.SysProcAttr{Setpgid: true} }
