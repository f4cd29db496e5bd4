package artifact

import (
	"errors"
	"fmt"
	"path/filepath"
	"strings"
)

// Ref names a model: host/namespace/model:tag, Ollama's grammar
// (ollama/ollama types/model/name.go ParseName and isValidPart @v0.17.4),
// e.g. "registry.ollama.ai/library/llama3.2:1b". Missing parts default to
// Ollama's: host "registry.ollama.ai", namespace "library", tag "latest".
// A valid Ref maps to a relative file path without "..", so names are safe
// in file names.
type Ref struct {
	Host, Namespace, Model, Tag string
}

// Defaults of a Ref's parts (Ollama's DefaultName).
const (
	DefaultHost      = "registry.ollama.ai"
	DefaultNamespace = "library"
	DefaultTag       = "latest"
)

// ErrRef reports a malformed model reference.
var ErrRef = errors.New("artifact: invalid model reference")

// ParseRef parses "[host/][namespace/]model[:tag]", filling defaults. A
// scheme prefix ("https://") is dropped. Every part is checked as Ollama
// checks it: host 1–350 bytes of [A-Za-z0-9_.:-], namespace 1–80 of
// [A-Za-z0-9_-], model and tag 1–80 of [A-Za-z0-9_.-], each starting with a
// letter, digit or underscore.
func ParseRef(s string) (Ref, error) {
	if len(s) > 600 {
		return Ref{}, fmt.Errorf("%w: %d bytes", ErrRef, len(s))
	}
	orig := s
	if _, after, ok := strings.Cut(s, "://"); ok {
		s = after
	}
	var r Ref
	if i, j := strings.LastIndexByte(s, ':'), strings.LastIndexByte(s, '/'); i > j {
		s, r.Tag = s[:i], s[i+1:]
	} else {
		r.Tag = DefaultTag
	}
	parts := strings.Split(s, "/")
	switch len(parts) {
	case 1:
		r.Host, r.Namespace, r.Model = DefaultHost, DefaultNamespace, parts[0]
	case 2:
		r.Host, r.Namespace, r.Model = DefaultHost, parts[0], parts[1]
	case 3:
		r.Host, r.Namespace, r.Model = parts[0], parts[1], parts[2]
	default:
		return Ref{}, fmt.Errorf("%w: %.100q has %d path parts", ErrRef, orig, len(parts))
	}
	if err := r.Validate(); err != nil {
		return Ref{}, fmt.Errorf("%w (in %.100q)", err, orig)
	}
	return r, nil
}

type refPart int

const (
	partHost refPart = iota
	partNamespace
	partModel
	partTag
)

// Validate checks every part (ParseRef's rules).
func (r Ref) Validate() error {
	for k, p := range [...]string{r.Host, r.Namespace, r.Model, r.Tag} {
		if !validPart(refPart(k), p) {
			return fmt.Errorf("%w: bad %s %.100q", ErrRef, [...]string{"host", "namespace", "model", "tag"}[k], p)
		}
	}
	return nil
}

func validPart(kind refPart, s string) bool {
	limit := 80
	if kind == partHost {
		limit = 350
	}
	if len(s) < 1 || len(s) > limit {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		alnum := c >= 'A' && c <= 'Z' || c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '_'
		switch {
		case alnum:
		case i == 0:
			return false
		case c == '-':
		case c == '.':
			if kind == partNamespace {
				return false
			}
		case c == ':':
			if kind != partHost {
				return false
			}
		default:
			return false
		}
	}
	return true
}

// String is "host/namespace/model:tag".
func (r Ref) String() string { return r.Host + "/" + r.Namespace + "/" + r.Model + ":" + r.Tag }

// Repository is the registry's name of the model, "namespace/model" (the
// OCI distribution path of Ollama's registry, server/images.go pullModelManifest).
func (r Ref) Repository() string { return r.Namespace + "/" + r.Model }

// Path is the manifest's path relative to the manifests folder,
// host/namespace/model/tag, as Ollama lays it out (types/model Name.Filepath).
// The parts cannot be "." or ".." (they start with a letter, digit or
// underscore), so the path stays inside the folder.
func (r Ref) Path() string { return filepath.Join(r.Host, r.Namespace, r.Model, r.Tag) }
