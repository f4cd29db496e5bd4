package simserver

import (
	"fmt"
	"slices"
	"strings"

	"github.com/infergate/infergate/openai"
)

// outputWords are the pseudo-words the HTTP front emits, one per output token.
var outputWords = strings.Fields(`
the of and to in is was for that on with as by at from his her they this had not are
but were which have one you all she there their been has when who will more would
time if no out so said what up its about into than them can only other new some could
these two may then first any like now my such make over our even most made after also
did many before must through back years where much your way well down should because
each just those people how too little state good very world still own see men work long
get here between both life being under never day same another know while last might us
great old year off come since against go came right used take three states himself few
house use during without again place around however home small found thought went say
part once general high upon school every does got united left number course war until
always away something fact though water less public put think almost hand enough far took
head yet government system better set told nothing night end why called didn find look
going asked later knew point next program city business give group toward young days let
room president side social present given several order national possible rather second
face per among form important often things looked early white case john become large big
need four within felt along children saw best church ever least power development light
`)

// outputVocab is what the engine draws output tokens from and how the HTTP
// front writes them: ids (sim.Config.OutputVocab), the ids of a reply's
// first token (sim.Config.FirstOutputVocab; nil: ids), the text of every
// id, and whether a reply sent back as the assistant's turn re-tokenizes
// to the ids the engine generated (replyRoundTrips).
type outputVocab struct {
	ids, first []uint32
	words      map[uint32]string
	roundTrip  bool
}

// minOutputWords is the fewest single-token words an output vocabulary
// may have.
const minOutputWords = 64

// wordVocab maps the output words to token ids of tok so that a reply made
// of them re-tokenizes to the same ids when a client sends it back as the
// assistant's turn of its next request: the property that makes the next
// turn hit the KV blocks of the reply, as on a real engine, and that the
// gateway's precise index predicts from the engine's KV events.
//
// cl100k_base (the canonical layout, which keeps a message's content as
// sent): every word " w" with its leading space, one token each.
//
// A model's own tokenizer: chat templates differ in what they do to an
// assistant's content (Llama-3's trims it, so a reply's leading space would
// be lost and its first token change), so a reply starts with a word
// without a space, as a model's reply does, and goes on with " w" words;
// when the template breaks that (replyRoundTrips), " w" words throughout
// are tried. When neither holds, the first scheme stays and roundTrip is
// false: follow-up turns then miss their replies' blocks (the server logs
// it).
func wordVocab(tok Tokenizer) (outputVocab, error) {
	v := outputVocab{words: make(map[uint32]string, 2*len(outputWords))}
	var err error
	if v.ids, err = singleTokenWords(tok, " ", v.words); err != nil {
		return outputVocab{}, err
	}
	if _, ok := tok.(cl100k); ok {
		v.roundTrip, err = replyRoundTrips(tok, v)
		return v, err
	}
	if v.first, err = singleTokenWords(tok, "", v.words); err != nil {
		return outputVocab{}, err
	}
	if v.roundTrip, err = replyRoundTrips(tok, v); err != nil || v.roundTrip {
		return v, err
	}
	spaced := v
	spaced.first = nil
	if spaced.roundTrip, err = replyRoundTrips(tok, spaced); err != nil || spaced.roundTrip {
		return spaced, err
	}
	return v, nil
}

// singleTokenWords returns the ids of the output words that, with lead
// before them, are exactly one token of tok, each id once, and records
// their text in words.
func singleTokenWords(tok Tokenizer, lead string, words map[uint32]string) ([]uint32, error) {
	var ids []uint32
	seen := make(map[uint32]bool, len(outputWords))
	for _, w := range outputWords {
		t, err := tok.Encode(nil, lead+w, false)
		if err != nil {
			return nil, fmt.Errorf("sim: output words: %w", err)
		}
		if len(t) != 1 || seen[t[0]] {
			continue
		}
		seen[t[0]] = true
		ids = append(ids, t[0])
		words[t[0]] = lead + w
	}
	if len(ids) < minOutputWords {
		return nil, fmt.Errorf("sim: only %d output words are single tokens of %s (with %q before them; want %d)",
			len(ids), tok.Name(), lead, minOutputWords)
	}
	return ids, nil
}

// replyRoundTrips reports whether a reply written in v, sent back as the
// assistant's turn of a follow-up, is tokenized as the engine generated it:
// the follow-up's ids start with the first turn's prompt (generation
// prompt included) followed by the reply's ids.
func replyRoundTrips(tok Tokenizer, v outputVocab) (bool, error) {
	first := v.first
	if first == nil {
		first = v.ids
	}
	reply := []uint32{first[0]}
	for i := 1; i < 12; i++ {
		reply = append(reply, v.ids[(7*i)%len(v.ids)])
	}
	var text strings.Builder
	for _, id := range reply {
		text.WriteString(v.words[id])
	}
	user := func(s string) openai.Message { return openai.Message{Role: "user", Content: textContent(s)} }
	prompt := func(msgs ...openai.Message) ([]uint32, error) {
		s, err := tok.RenderChat(ChatPrompt{Messages: msgs, AddGenerationPrompt: true})
		if err != nil {
			return nil, fmt.Errorf("sim: rendering a chat with %s: %w", tok.Name(), err)
		}
		return tok.Encode(nil, s, false)
	}
	turn1, err := prompt(user("Write a few words."))
	if err != nil {
		return false, err
	}
	turn2, err := prompt(user("Write a few words."), openai.Message{Role: "assistant", Content: textContent(text.String())}, user("Thanks."))
	if err != nil {
		return false, err
	}
	want := append(turn1, reply...)
	return len(turn2) >= len(want) && slices.Equal(turn2[:len(want)], want), nil
}
