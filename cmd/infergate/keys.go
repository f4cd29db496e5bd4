package main

import (
	"bufio"
	"crypto/rand"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/infergate/infergate/auth"
)

func newKeysCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "keys",
		Short: "Create and hash API keys for the gateway's keys file",
		Long: `The gateway stores API keys only as SHA-256 hashes (auth.keys_file, or the
INFERGATE_API_KEYS environment variable). 'keys new' makes a random key and
prints it with its keys-file line; 'keys hash' hashes an existing key (the same
as: printf %s "$KEY" | sha256sum).`,
		Args: cobra.NoArgs,
	}
	cmd.AddCommand(newKeysHashCmd(), newKeysNewCmd())
	return cmd
}

func newKeysHashCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "hash [KEY]",
		Short: "Print the sha256:<hex> hash of a key (read from stdin when not given)",
		Long: `Print the hash to put in a keys file. Without an argument the key is read from
the first line of standard input, which keeps it out of the shell history.`,
		Example: `  infergate keys hash < key.txt
  printf %s "$KEY" | infergate keys hash`,
		Args: cobra.MaximumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			var key string
			if len(args) == 1 {
				key = args[0]
			} else {
				line, err := bufio.NewReader(cmd.InOrStdin()).ReadString('\n')
				if err != nil && !errors.Is(err, io.EOF) {
					return err
				}
				key = strings.TrimRight(line, "\r\n")
			}
			if key == "" {
				return errors.New("empty key")
			}
			fmt.Fprintln(cmd.OutOrStdout(), auth.HashKey(key))
			return nil
		},
	}
}

// keysNewFlags are keys new's flags (bind): the limits written into the
// keys-file line.
type keysNewFlags struct {
	models      []string
	rpm, tpm    int
	maxPriority int
}

func newKeysNewCmd() *cobra.Command {
	var fl keysNewFlags
	cmd := &cobra.Command{
		Use:   "new NAME",
		Short: "Generate a random key and print it with its keys-file line",
		Long: `Generate a key of 256 random bits. The key is printed once, on the first line;
the second line is the entry for a keys file (one key per line format), which
holds only the key's hash.`,
		Example: `  infergate keys new team-a --models meta-llama/Llama-3.1-8B-Instruct --rpm 600 --tpm 200000 --max-priority 0`,
		Args:    cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			var b [32]byte
			if _, err := rand.Read(b[:]); err != nil {
				return err
			}
			key := "sk-ig-" + base64.RawURLEncoding.EncodeToString(b[:])
			line := fl.line(args[0], auth.HashKey(key), cmd.Flags().Changed("max-priority"))
			if _, err := auth.ParseKeys([]byte(line), false); err != nil {
				return err
			}
			out := cmd.OutOrStdout()
			fmt.Fprintln(out, key)
			fmt.Fprintln(out, line)
			return nil
		},
	}
	fl.bind(cmd.Flags())
	return cmd
}

// bind registers keys new's flags on f.
func (fl *keysNewFlags) bind(f *pflag.FlagSet) {
	f.StringSliceVar(&fl.models, "models", nil, "models the key may use (comma-separated; default all)")
	f.IntVar(&fl.rpm, "rpm", 0, "requests per minute (0: no limit)")
	f.IntVar(&fl.tpm, "tpm", 0, "prompt + completion tokens per minute (0: no limit)")
	f.IntVar(&fl.maxPriority, "max-priority", 0, "highest X-Priority the key's requests queue with (a higher one is lowered to it; not given: no cap)")
}

// line is the keys-file line of the key called name with hash: the
// models and the limits given (max_priority only when capped).
func (fl *keysNewFlags) line(name, hash string, capped bool) string {
	line := name + " " + hash
	if len(fl.models) > 0 {
		line += " models=" + strings.Join(fl.models, ",")
	}
	if fl.rpm > 0 {
		line += " rpm=" + strconv.Itoa(fl.rpm)
	}
	if fl.tpm > 0 {
		line += " tpm=" + strconv.Itoa(fl.tpm)
	}
	if capped {
		line += " max_priority=" + strconv.Itoa(fl.maxPriority)
	}
	return line
}
