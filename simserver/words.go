package simserver

import (
	"fmt"
	"strings"

	"github.com/infergate/infergate/prefix"
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

// wordVocab maps the output words to their cl100k token ids: each word with a
// leading space must be exactly one token, so that text made of these words
// re-tokenizes to the same ids (the property that makes a client's next chat
// turn hit the cached output blocks, as on a real engine).
func wordVocab(tok *prefix.Tokenizer) (ids []uint32, words map[uint32]string, err error) {
	words = make(map[uint32]string, len(outputWords))
	for _, w := range outputWords {
		t := tok.Encode(" " + w)
		if len(t) != 1 {
			continue
		}
		if _, dup := words[t[0]]; dup {
			continue
		}
		ids = append(ids, t[0])
		words[t[0]] = " " + w
	}
	if len(ids) < 64 {
		return nil, nil, fmt.Errorf("sim: only %d output words are single tokens", len(ids))
	}
	return ids, words, nil
}
