//go:build ignore

// Command protogen compiles .proto files with protocompile and runs protoc
// plugins on them (a protoc stand-in for machines without protoc).
package main

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"

	"github.com/bufbuild/protocompile"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protodesc"
	"google.golang.org/protobuf/types/descriptorpb"
	"google.golang.org/protobuf/types/pluginpb"
)

// usage: protogen -I dir -out dir -plugin path=params ... file.proto
func main() {
	var inc, out string
	var plugins []string
	var files []string
	a := os.Args[1:]
	for i := 0; i < len(a); i++ {
		switch a[i] {
		case "-I":
			i++
			inc = a[i]
		case "-out":
			i++
			out = a[i]
		case "-plugin":
			i++
			plugins = append(plugins, a[i])
		default:
			files = append(files, a[i])
		}
	}
	c := protocompile.Compiler{Resolver: protocompile.WithStandardImports(&protocompile.SourceResolver{ImportPaths: []string{inc}}), SourceInfoMode: protocompile.SourceInfoStandard}
	fds, err := c.Compile(context.Background(), files...)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	var protos []*descriptorpb.FileDescriptorProto
	seen := map[string]bool{}
	var add func(fd interface{ Path() string })
	_ = add
	for _, f := range fds {
		imps := f.Imports()
		for i := 0; i < imps.Len(); i++ {
			p := imps.Get(i).FileDescriptor
			if !seen[p.Path()] {
				seen[p.Path()] = true
				protos = append(protos, protodesc.ToFileDescriptorProto(p))
			}
		}
		if !seen[f.Path()] {
			seen[f.Path()] = true
			protos = append(protos, protodesc.ToFileDescriptorProto(f))
		}
	}
	for _, pl := range plugins {
		path, params, _ := strings.Cut(pl, "=")
		req := &pluginpb.CodeGeneratorRequest{FileToGenerate: files, Parameter: proto.String(params), ProtoFile: protos}
		in, _ := proto.Marshal(req)
		cmd := exec.Command(path)
		cmd.Stdin = bytes.NewReader(in)
		cmd.Stderr = os.Stderr
		b, err := cmd.Output()
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		var resp pluginpb.CodeGeneratorResponse
		if err := proto.Unmarshal(b, &resp); err != nil {
			panic(err)
		}
		if resp.Error != nil {
			fmt.Fprintln(os.Stderr, *resp.Error)
			os.Exit(1)
		}
		for _, f := range resp.File {
			p := filepath.Join(out, f.GetName())
			os.MkdirAll(filepath.Dir(p), 0o755)
			if err := os.WriteFile(p, []byte(f.GetContent()), 0o644); err != nil {
				panic(err)
			}
			fmt.Println("wrote", p)
		}
	}
}
